"""Shared test set-up: verdicts of ``autopar verify`` are cached in a directory of this session
(not the user's ``~/.cache``), shared by every test and the torchrun jobs they start."""

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def verify_cache(tmp_path_factory):
    old = os.environ.get("AUTOPAR_CACHE")
    os.environ["AUTOPAR_CACHE"] = str(tmp_path_factory.mktemp("autopar-cache"))
    yield
    if old is None:
        os.environ.pop("AUTOPAR_CACHE", None)
    else:
        os.environ["AUTOPAR_CACHE"] = old
