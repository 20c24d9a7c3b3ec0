"""WorkerSettings through pydantic-settings: MLXQ_* variables, a .env file, the flags, errors that name
the variable; and no secret (a Redis password) in any log line, --help, `mlxq info` or error message."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from mlxq.cli import build_parser
from producer import Client
from producer.api.settings import GatewaySettings
from worker.settings import SettingsError, WorkerSettings, env_name
from tests.workers import start_fake_worker, stop

SECRET = "planted-Secret-7f3a9"


def test_every_setting_has_a_flag():
    worker_parser = build_parser()._subparsers._group_actions[0].choices["worker"]  # type: ignore[union-attr]
    dests = {action.dest for action in worker_parser._actions}
    missing = [name for name in WorkerSettings.model_fields if name not in dests and name != "redis_url"]
    assert missing == []
    assert "url" in dests  # redis_url's flag is --url


def _documented_defaults() -> dict[str, str]:
    text = (Path(__file__).parents[1] / "docs" / "configuration.md").read_text()
    return {m[1]: m[2].strip() for m in re.finditer(r"^\| `(MLXQ_[A-Z0-9_]+)` \| ([^|]+) \|", text, re.M)}


def _default_shown(value: object) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def test_every_setting_is_documented_with_its_default():
    documented = _documented_defaults()
    fields = [(env_name(name), field.default) for name, field in WorkerSettings.model_fields.items()]
    fields += [(field.validation_alias.choices[0] if field.validation_alias else f"MLXQ_API_{name.upper()}",
                field.default) for name, field in GatewaySettings.model_fields.items() if name != "priorities"]
    missing = [variable for variable, _ in fields if variable not in documented]
    assert not missing, f"docs/configuration.md lacks {missing}"
    wrong = {variable: (documented[variable], default) for variable, default in fields
             if isinstance(default, (int, float)) and not isinstance(default, bool)
             and documented[variable] != _default_shown(default)}
    assert not wrong, f"docs/configuration.md shows other defaults (doc, code): {wrong}"


def test_environment_dotenv_and_flags_in_that_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text("MLXQ_MAX_NUM_SEQS=7\nMLXQ_ALIAS=from-dotenv\nMLXQ_PRIORITIES=high,default\n"
                                   "MLXQ_TRUST_REMOTE_CODE=yes\n")
    for name in ("MLXQ_MAX_NUM_SEQS", "MLXQ_ALIAS", "MLXQ_PRIORITIES", "MLXQ_TRUST_REMOTE_CODE", "MLXQ_MODEL"):
        monkeypatch.delenv(name, raising=False)
    settings = WorkerSettings.from_env()
    assert (settings.max_num_seqs, settings.alias, settings.priorities) == (7, "from-dotenv", ("high", "default"))
    assert settings.trust_remote_code is True
    monkeypatch.setenv("MLXQ_MAX_NUM_SEQS", "9")
    assert WorkerSettings.from_env().max_num_seqs == 9  # the variable beats .env
    assert WorkerSettings.from_env(max_num_seqs=11).max_num_seqs == 11  # a flag beats both
    assert WorkerSettings.from_env({}).max_num_seqs == 32  # an explicit environment alone
    assert WorkerSettings().max_num_seqs == 32 and WorkerSettings().alias is None  # plain construction reads neither


def test_errors_name_the_variable_and_the_flag():
    with pytest.raises(SettingsError, match=r"MLXQ_MAX_NUM_SEQS \(--max-num-seqs\): .*integer.*'lots'"):
        WorkerSettings.from_env({"MLXQ_MAX_NUM_SEQS": "lots"})
    with pytest.raises(SettingsError, match=r"MLXQ_TRUST_REMOTE_CODE .*'maybe'"):
        WorkerSettings.from_env({"MLXQ_TRUST_REMOTE_CODE": "maybe"})
    with pytest.raises(SettingsError, match="MLXQ_PREFIX_CACHE_MB must be >= 0"):
        WorkerSettings.from_env({"MLXQ_PREFIX_CACHE_MB": "-1"})
    with pytest.raises(SettingsError, match="MLXQ_PROCESSES must be >= 1"):
        WorkerSettings.from_env({"MLXQ_PROCESSES": "0"})


def test_the_redis_url_is_a_secret():
    url = f"redis://:{SECRET}@127.0.0.1:1/0"
    settings = WorkerSettings.from_env({"MLXQ_REDIS_URL": url})
    assert settings.redis_url_value == url and settings.to_env()["MLXQ_REDIS_URL"] == url
    assert SECRET not in repr(settings) and SECRET not in str(settings)
    with pytest.raises(SettingsError) as raised:
        WorkerSettings.from_env({"MLXQ_REDIS_URL": url, "MLXQ_MAX_NUM_SEQS": "0"})
    assert SECRET not in str(raised.value)


def run(*args: str, env: dict[str, str], timeout: float = 60) -> str:
    done = subprocess.run([sys.executable, "-m", "mlxq", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env})
    return done.stdout + done.stderr


@pytest.mark.slow
def test_no_secret_in_logs_help_info_or_errors(redis_server, tmp_path):
    from mlxq.redis_server import RedisServer, free_port

    with RedisServer() as server:
        redis.Redis.from_url(server.url).config_set("requirepass", SECRET)
        url = f"redis://:{SECRET}@127.0.0.1:{server.port}/0"
        env = {"MLXQ_REDIS_URL": url}
        worker = start_fake_worker(url, "--log-level", "DEBUG", name="secretive", env=env)
        client = Client(url)
        try:
            assert client.wait(client.submit({"prompt_token_ids": [5, 6], "max_tokens": 3}), timeout=60).status == \
                "finished"
            outputs = {"info": run("info", env=env), "info --json": run("info", "--json", "--url", url, env=env),
                       "stats": run("stats", "--json", env=env)}
        finally:
            client.close()
            worker_log = stop(worker)
        outputs.update({
            "worker log": worker_log,
            "worker --help": run("worker", "--help", env=env),
            "api --help": run("api", "--help", env=env),
            "a bad setting": run("worker", "--engine", "fake", env={**env, "MLXQ_MAX_NUM_SEQS": "lots"}),
            "a wrong password": run("info", env={"MLXQ_REDIS_URL": url.replace(SECRET, SECRET + "x")}),
            "no Redis there": run("stats", env={"MLXQ_REDIS_URL": f"redis://:{SECRET}@127.0.0.1:{free_port()}/0"}),
            "a worker that cannot connect": run(
                "worker", "--engine", "fake", "--burst",
                env={"MLXQ_REDIS_URL": f"redis://:{SECRET}@127.0.0.1:{free_port()}/0"}, timeout=120),
        })
    assert "secretive" in outputs["info"] and "secretive" in outputs["stats"]  # they did run
    assert "MLXQ_MAX_NUM_SEQS" in outputs["a bad setting"]
    leaked = [what for what, text in outputs.items() if SECRET in text]
    assert leaked == [], {what: outputs[what][-2000:] for what in leaked}


# Every setting holding several values, in the comma-separated form docs/configuration.md writes, and
# what it must read as. A new such setting without an entry here fails the test below.
LIST_SETTINGS = {
    "MLXQ_API_KEYS": ("ops:" + "ab" * 32 + ", acme:" + "cd" * 32, lambda s: [k.tenant for k in s.api_keys],
                      ["ops", "acme"]),
    "MLXQ_API_ADMIN_TENANTS": ("ops", lambda s: s.admin_tenants, ("ops",)),
    "MLXQ_API_MODELS": ("qwen, llama", lambda s: s.models, ("qwen", "llama")),
    "MLXQ_PRIORITIES": ("high,default", lambda s: s.priorities, ("high", "default")),
    "MLXQ_CALLBACK_ALLOWLIST": ("myapp.hooks.,other.", lambda s: s.callback_allowlist, ("myapp.hooks.", "other.")),
    "MLXQ_IMAGE_FETCH_ALLOW_NETS": ("10.1.2.0/24, 192.168.0.0/16", lambda s: s.image_fetch_allow_nets,
                                    ("10.1.2.0/24", "192.168.0.0/16")),
}


def _list_fields(model: type) -> dict[str, str]:
    """{variable: field name} of the fields of `model` typed as tuples."""
    found = {}
    for name, field in model.model_fields.items():
        if getattr(field.annotation, "__origin__", None) is tuple or field.annotation is tuple:
            alias = field.validation_alias.choices[0] if field.validation_alias else None
            found[alias or (env_name(name) if model is WorkerSettings else f"MLXQ_API_{name.upper()}")] = name
    return found


@pytest.mark.parametrize("variable", sorted(LIST_SETTINGS))
def test_every_list_setting_takes_its_documented_comma_separated_form(variable, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # no .env
    listed = {**_list_fields(GatewaySettings), **_list_fields(WorkerSettings)}
    assert set(listed) == set(LIST_SETTINGS), "a list setting without a case here"
    value, read, expected = LIST_SETTINGS[variable]
    monkeypatch.setenv(variable, value)
    if variable.startswith("MLXQ_API_") or variable == "MLXQ_PRIORITIES":
        assert read(GatewaySettings()) == expected
    if not variable.startswith("MLXQ_API_"):
        monkeypatch.setenv("MLXQ_MODEL", "m")
        assert read(WorkerSettings.from_env()) == expected
