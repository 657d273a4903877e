"""Deliberately bad model factories for the bad-input tests."""


def not_a_module():
    return 42


def raises():
    raise RuntimeError("boom")
