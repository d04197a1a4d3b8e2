"""ServerConfig from TOML and flags; the anonymous (no key) mode; the serve command's parser."""

from __future__ import annotations

import argparse

import httpx
import openai
import pytest

from kvtier.errors import KvtierError
from kvtier.server import command
from kvtier.settings.server import ServerConfig, parse_tenant_flag
from tests.server.conftest import MODEL, start_server, stop_server, wait_idle


def test_toml(tmp_path):
    path = tmp_path / "kvtier.toml"
    path.write_text(
        """
[server]
model_name = "tiny"
admin_key = "adm"
max_prompt_tokens = 100

[server.tenants.acme]
api_key = "k1"
device_quota_bytes = 1000000

[server.tenants.beta]
api_key = "k2"
"""
    )
    config = ServerConfig.from_toml(path)
    assert config.model_name == "tiny" and config.max_prompt_tokens == 100
    assert config.tenants["acme"].device_quota_bytes == 1_000_000
    assert config.tenants["beta"].device_quota_bytes is None
    assert config.tenant_for_key("k2").name == "beta"
    assert config.tenant_for_key("nope") is None
    assert not config.anonymous


@pytest.mark.parametrize(
    "text",
    [
        "[server]\nbogus = 1",
        "[server.tenants.a]\napi_key = 3",
        "[server.tenants.a]\napi_key = 'x'\ndevice_quota_bytes = -1",
        "[server.tenants.a]\napi_key = 'x'\n[server.tenants.b]\napi_key = 'x'",
        "[server]\nmax_concurrent_requests = 0",
        "not toml [",
    ],
)
def test_bad_toml(tmp_path, text):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(KvtierError):
        ServerConfig.from_toml(path)


def test_tenant_flag_and_parser():
    assert parse_tenant_flag("acme:sk:123").device_quota_bytes == 123
    for bad in ("acme", "acme::1", "a:b:c:d", "a:b:x"):
        with pytest.raises(KvtierError):
            parse_tenant_flag(bad)
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(
        ["--tenant", "acme:sk-a:1000", "--admin-key", "adm", "--max-prompt-tokens", "64"]
    )
    config = command.build_server_config(args)
    assert config.tenants["acme"].api_key == "sk-a" and config.max_prompt_tokens == 64


@pytest.mark.slow
def test_anonymous_mode(engine):
    from kvtier.server.app import create_app

    srv, thread = start_server(create_app(engine, ServerConfig(max_tokens_default=2)))
    try:
        client = openai.OpenAI(base_url=srv.v1, api_key="anything", max_retries=0)
        resp = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hello"}], user="u1"
        )
        assert resp.usage.completion_tokens <= 2
        tenants = httpx.get(srv.base_url + "/admin/tenants").json()["data"]  # open locally
        assert [t["tenant"] for t in tenants] == ["anonymous"]
        cleared = httpx.post(srv.base_url + "/admin/tenants/anonymous/clear")
        assert cleared.status_code == 200
    finally:
        stop_server(srv, thread)
    wait_idle(engine)


@pytest.mark.slow
@pytest.mark.parametrize("flag", [[], ["--paged-decode"], ["--no-paged-decode"]])
def test_paged_decode_flag_builds_an_engine_that_decodes_from_the_pool(flag):
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args([*flag, "--kv-cache-bytes", str(64 << 20), "--threads", "2"])
    engine = command.build_engine(args)
    try:
        # on by default and with the flag, the kernel built here (g++ is a test dependency);
        # off with --no-paged-decode: gather + SDPA
        assert engine.model.attention.pages_decode == (flag != ["--no-paged-decode"])
        from kvtier.server.app import create_app

        srv, thread = start_server(create_app(engine, command.build_server_config(args)))
        try:
            client = openai.OpenAI(base_url=srv.v1, api_key="anything", max_retries=0)
            resp = client.completions.create(
                model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0
            )
            # six tokens: five of them decoded (by the kernel unless it is off), over HTTP
            assert resp.usage.completion_tokens == 6 and resp.choices[0].text.strip()
        finally:
            stop_server(srv, thread)
        wait_idle(engine)
    finally:
        engine.close()
