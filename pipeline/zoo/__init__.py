"""Model zoos: the on-disk format and the generators of real zoos."""
