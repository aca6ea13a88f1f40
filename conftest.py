"""Root pytest plug-in: the shared fixtures and the ``cuda`` marker's skip logic."""

pytest_plugins = ["torchstash.testing.fixtures"]
