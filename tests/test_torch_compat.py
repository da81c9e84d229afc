"""The hot tier refuses a transformers that would ignore ``cache=`` (seen on a GPU machine
with transformers 5.17: the model ran without the session's KV and generate refused)."""

from __future__ import annotations

import pytest

from kvfs.torch.compat import MIN_TRANSFORMERS, check_transformers


@pytest.mark.parametrize("version", ["5.17.0", "5.23.1", "4.57.1", "6.0.0", "5.0.0rc1"])
def test_older_or_other_major_is_refused_with_the_fix(version):
    with pytest.raises(RuntimeError, match=rf"transformers>={MIN_TRANSFORMERS},<6.*this is {version}"):
        check_transformers(version)


@pytest.mark.parametrize("version", ["5.24.0", "5.25.0", "5.39.2", "5.40.0.dev0"])
def test_versions_with_the_cache_keyword_pass(version):
    check_transformers(version)


def test_unreadable_version_is_refused():
    with pytest.raises(RuntimeError, match="cannot read"):
        check_transformers("not-a-version")


def test_a_cache_is_not_built_over_an_older_transformers(monkeypatch):
    from kvfs.torch import TieredCache, compat
    from kvfs.torch.reference import tiny_llama

    model = tiny_llama(seed=0)
    monkeypatch.setattr(compat, "installed_transformers", lambda: "5.17.0")
    with pytest.raises(RuntimeError, match="needs transformers"):
        TieredCache(model, max_kv_len=8)


def test_installed_transformers_takes_cache_keyword():
    import inspect

    from transformers import LlamaForCausalLM

    assert "cache" in inspect.signature(LlamaForCausalLM.forward).parameters
