"""What the tests share: servers and clients (``serving``), image checks (``images``), the README's
examples (``readme``), hypothesis strategies of client input (``client_inputs``) and a stand-in
engine for the service (``stand_ins``). Fixtures live in the conftest files and build on these."""
