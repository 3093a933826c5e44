# Shared fixtures live in tests/fixtures/*.py, one module per real server or fake; register here.
pytest_plugins = [
    "tests.fixtures.s3",
    "tests.fixtures.fake_hub",
    "tests.fixtures.sshd",
    "tests.fixtures.hf_writer",
    "tests.fixtures.sync_engine",
    "tests.fixtures.smtp",
    "tests.fixtures.clock",
    "tests.fixtures.daemon",
    "tests.fixtures.nvml",
    "tests.fixtures.smtp_tls",
    "tests.fixtures.idle",
]
