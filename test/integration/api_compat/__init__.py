"""Client-compatibility tests; a package so that its conftest's package-scoped server is started once for all of them."""
