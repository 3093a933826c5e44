"""What stop.action means on this machine, resolved once (the daemon at start, check-config): the
provider named or found, connected with its credential, asked what this machine costs, and the
pure decision of stop.choose. It asks the network only where a provider was named or found, and
only that provider's metadata service and API.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from types import ModuleType

import structlog

from supervisor import redact
from supervisor.config import Config, StopConfig
from supervisor.stop.choose import PROVIDER_ACTIONS, Plan, decide
from supervisor.stop.providers import aws, azure, detect, gcp, lambda_cloud, runpod, vast, warn_only
from supervisor.stop.providers.base import Found, Info, NoCredential, ProviderError

log = structlog.get_logger("stop")

CALLED: dict[str, ModuleType] = {"runpod": runpod, "vast": vast, "lambda": lambda_cloud, "aws": aws, "gcp": gcp,
                                 "azure": azure}
INFOS: dict[str, Info] = {**{k: m.INFO for k, m in CALLED.items()}, **warn_only.INFOS}
NAMES = tuple(INFOS)
# whose API tells this machine's hourly price with a key the machine holds: asked for the price even
# when the stop itself is a command or a poweroff
PRICED = ("runpod", "vast", "lambda")


def read_key(path: str) -> str:
    """The first non-empty line of stop.api_key_file ("" when unset or unreadable)."""
    if not path:
        return ""
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            key = next((ln.strip() for ln in f.read(64 * 1024).splitlines() if ln.strip()), "")
    except (OSError, UnicodeDecodeError):
        return ""
    redact.register(key)
    return key


def found_for(cfg: StopConfig, env: dict[str, str], dmi_root: str = detect.DMI_ROOT) -> Found | None:
    """The provider this stop is for: named (stop.provider, or action "ec2"), else detected."""
    if cfg.action == "ec2":
        return Found("aws", "stop.action = \"ec2\"", cfg.instance_id)
    if cfg.provider == "none":
        return None
    if cfg.provider != "auto":
        return Found(cfg.provider, f"stop.provider = \"{cfg.provider}\"", cfg.instance_id)
    got = detect.find(env, dmi_root)
    if got is None and cfg.api_key_file:
        return Found("lambda", "stop.api_key_file", cfg.instance_id)  # the one provider keyed by a file this version
    return got


def choose(cfg: StopConfig, env: dict[str, str] | None = None, *, dmi_root: str = detect.DMI_ROOT,
           proc_root: str = detect.PROC_ROOT, describe: bool = True, quiet: bool = False) -> Plan:
    """What the stop does on this machine. Never raises: what cannot be learned is said in the plan.
    `quiet`: log nothing (check-config prints the plan itself)."""
    lg = _Quiet() if quiet else log
    env = detect.provider_env(dict(os.environ) if env is None else env, proc_root)
    redact.register(env.get("RUNPOD_API_KEY"), env.get("CONTAINER_API_KEY"))
    found = found_for(cfg, env, dmi_root)
    info = INFOS.get(found.name) if found else None
    provider, why, facts = None, "", None
    wanted = info is not None and info.api and found is not None and (
        cfg.action in PROVIDER_ACTIONS or (cfg.action in ("command", "poweroff") and found.name in PRICED))
    if wanted and found is not None:
        try:
            provider = CALLED[found.name].connect(cfg, env, found, read_key(cfg.api_key_file))
        except NoCredential as e:
            why = str(e)
        except Exception as e:  # noqa: BLE001 - a provider module's surprise must not stop the daemon
            why = f"{type(e).__name__}: {redact.redact(str(e))[:200]}"
            lg.exception("stop_provider_connect_failed", provider=found.name)
    if provider is not None and describe:
        try:
            facts = provider.describe()
        except (ProviderError, OSError) as e:
            lg.warning("stop_provider_describe_failed", provider=found.name if found else "", error=str(e))
    action, warning, problem = decide(cfg.action, cfg.mode, found, info, provider is not None, why)
    plan = Plan(cfg.action, action, cfg.mode, found, info, provider if action == "provider" else None, facts,
                why, warning, problem)
    lg.info("stop_plan", action=action, provider=found.name if found else None,
             detected_by=found.detected_by if found else "", line=plan.line(), warning=warning or None)
    return plan


class _Quiet:
    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *a, **k: None


def priced(cfg: Config, plan: Plan, say: Callable[..., None] | None = None) -> Config:
    """The config with the provider's hourly price where its API reported one and the config sets
    none (in USD, the providers' currency: a config in another currency keeps its own)."""
    price = plan.price_per_hour
    if cfg.price_per_hour is not None or price is None or cfg.currency.upper() != "USD":
        return cfg
    (say or log.info)("price_from_provider", price_per_hour=price, provider=plan.found.name if plan.found else "")
    return dataclasses.replace(cfg, price_per_hour=price)
