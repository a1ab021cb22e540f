"""The backend contract on the local backend (nodes simulated on this host)."""

from tests.launch.backends.contract import BackendContract


class TestLocalBackend(BackendContract):
    backend = "local"
