"""AWS EC2: a guest poweroff stops an EBS-backed instance (unless its InstanceInitiatedShutdownBehavior
says terminate); `halt` does not. The API stop (StopInstances) and terminate (TerminateInstances) go
through boto3 with the usual credential chain (the instance profile on the machine); the state is
DescribeInstances' State.Name ("stopped", "terminated"). EBS volumes and Elastic IPs bill on after a
stop. The instance and its region come from IMDSv2 (a PUT for a session token, then GETs with it)."""

from __future__ import annotations

from typing import Any

from supervisor.config import StopConfig
from supervisor.stop.providers.api import get_text
from supervisor.stop.providers.base import (
    Facts,
    Found,
    Info,
    NoCredential,
    ProviderError,
    State,
    StopActionError,
)

INFO = Info(
    name="aws", label="AWS EC2", noun="instance", found_by="DMI sys_vendor \"Amazon EC2\" (or bios_version ...amazon)",
    poweroff_ends_billing=True,
    poweroff_means="stops an EBS-backed instance (unless InstanceInitiatedShutdownBehavior is terminate)",
    can_stop=True, api=True, stop_ends="ends compute billing",
    stop_keeps="EBS volumes and any Elastic IP", terminate_keeps="EBS volumes not deleted on termination, snapshots",
    credential="the usual boto3 chain (the instance profile), ec2:StopInstances / TerminateInstances / DescribeInstances",
    fix="an instance profile allowed ec2:StopInstances and ec2:DescribeInstances on this instance")


def imds_instance(imds_url: str, region: str = "", timeout: float = 3.0) -> tuple[str, str]:
    """(instance id, region) from the instance metadata service, IMDSv2 (session token first)."""
    base = imds_url.rstrip("/")
    try:
        token = get_text(f"{base}/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "300"}, timeout, "PUT")
        iid = get_text(f"{base}/latest/meta-data/instance-id", {"X-aws-ec2-metadata-token": token}, timeout)
        reg = region or get_text(f"{base}/latest/meta-data/placement/region", {"X-aws-ec2-metadata-token": token},
                                 timeout)
    except ProviderError as e:
        raise StopActionError(f"instance metadata (IMDSv2) at {base} unavailable: {e}; "
                              "is this an EC2 instance?") from None
    if not iid.startswith("i-"):
        raise StopActionError(f"instance metadata returned an unexpected instance id {iid[:40]!r}")
    return iid, reg


def _client(region: str, endpoint: str) -> Any:
    import boto3
    from botocore.config import Config as BotoConfig

    return boto3.session.Session().client(
        "ec2", region_name=region, endpoint_url=endpoint or None,
        config=BotoConfig(connect_timeout=10, read_timeout=30, retries={"max_attempts": 1, "mode": "standard"}))


def _call(what: str, fn: Any, **kw: Any) -> dict:
    """One request (no retries: exactly one call per attempt); botocore's errors as ProviderError."""
    from botocore.exceptions import BotoCoreError, ClientError, ConnectTimeoutError, ReadTimeoutError

    try:
        return fn(**kw)
    except ClientError as e:
        code = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 400)
        raise ProviderError(f"{what} failed: {e}", "refused" if code < 500 else "failed", code,
                            str(e)[:300]) from None
    except ReadTimeoutError as e:
        raise ProviderError(f"{what}: no answer ({e})", "unknown") from None
    except (ConnectTimeoutError, BotoCoreError) as e:
        raise ProviderError(f"{what} failed: {e}", "failed") from None


class Aws:
    info = INFO

    def __init__(self, client: Any, instance: str, region: str):
        self.client, self.instance, self.region = client, instance, region

    def describe(self) -> Facts:
        return Facts(None, INFO.stop_keeps + " still billed", "", f"instance {self.instance} in {self.region}")

    def _verb(self, name: str, fn: Any, key: str) -> str:
        resp = _call(f"ec2 {name} {self.instance} in {self.region}", fn, InstanceIds=[self.instance])
        states = resp.get(key) or [{}]
        prev = states[0].get("PreviousState", {}).get("Name", "?")
        cur = states[0].get("CurrentState", {}).get("Name", "?")
        return f"ec2 {name} {self.instance} in {self.region}: {prev} -> {cur}"

    def stop(self) -> str:
        return self._verb("StopInstances", self.client.stop_instances, "StoppingInstances")

    def terminate(self) -> str:
        return self._verb("TerminateInstances", self.client.terminate_instances, "TerminatingInstances")

    def state(self) -> State:
        resp = _call(f"ec2 DescribeInstances {self.instance}", self.client.describe_instances,
                     InstanceIds=[self.instance])
        insts = [i for r in resp.get("Reservations") or [] for i in r.get("Instances") or []]
        if not insts:
            return State("gone", True, True)
        word = str(insts[0].get("State", {}).get("Name") or "?")
        return State(word, word in ("stopped", "terminated"), word == "terminated")


def connect(cfg: StopConfig, env: dict[str, str], found: Found, key: str = "", timeout: float = 1.0) -> Aws:
    """The instance from stop.instance_id or IMDSv2, and a client with the credential chain's keys
    (none found: NoCredential, and the auto stop falls back to poweroff, which stops EBS instances)."""
    base = cfg.metadata_url or cfg.imds_url
    iid = cfg.instance_id or found.instance
    try:
        got, region = imds_instance(base, cfg.ec2_region, timeout=timeout) if not (iid and cfg.ec2_region) \
            else (iid, cfg.ec2_region)
    except StopActionError as e:
        raise NoCredential(str(e)) from None
    import boto3

    if boto3.session.Session().get_credentials() is None:  # the chain: env, ~/.aws, the instance profile
        raise NoCredential("no AWS credentials (no instance profile, no keys in the environment or ~/.aws)")
    return Aws(_client(region, cfg.api_url or cfg.ec2_endpoint_url), iid or got, region)


def ec2_stop(cfg: StopConfig) -> str:
    """StopInstances on this instance (the pre-provider action "ec2", kept for its callers)."""
    iid, region = imds_instance(cfg.imds_url, cfg.ec2_region)
    return Aws(_client(region, cfg.ec2_endpoint_url), iid, region).stop()
