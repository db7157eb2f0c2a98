"""Test doubles and contract suites for kvtier and for code built on it.

Production code never imports this package. `fake_verbs` (an in-process stand-in for pyverbs),
`mooncake_master` (a Mooncake master subprocess), `pool` (nodes over the fake verbs), `devices`
(which special devices this host has), and the contract suites: `tier_contract.TierContract`."""
