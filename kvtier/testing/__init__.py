"""Test doubles and contract suites for kvtier and for code built on it.

Production code never imports this package (tests/test_layout.py checks it).

Contract suites, each a pytest class to subclass with the fixtures its docstring names, so an
out-of-tree tier, policy or transport runs exactly what kvtier's own do:
`tier_contract.TierContract`, `policy_contract.PolicyContract` (with `policy_machine`, the stateful
test), `transport_contract.TransportContract`.

Doubles: `fake_verbs` (a software RDMA NIC with pyverbs' names), `pool` (nodes over it),
`mooncake_master` (a Mooncake master subprocess), `devices` (which special devices this host has).
"""
