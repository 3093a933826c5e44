"""Where the S3 requests go: the store's host (sync.endpoint_url, AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL,
the profile's endpoint_url, else AWS's regional host, with FIPS and dual-stack names as AWS documents
them), the proxy in between (HTTPS_PROXY / HTTP_PROXY / NO_PROXY, as botocore reads them) and the
CA bundle (AWS_CA_BUNDLE or the profile's ca_bundle). `resolve` is pure; `Endpoint.connect` makes
the http.client connection. A setting it cannot honour is a TargetError naming it, never ignored.

AWS host names (docs.aws.amazon.com/general/latest/gr/s3.html):
  s3.<region>.amazonaws.com, s3-fips.<region>.amazonaws.com, s3.dualstack.<region>.amazonaws.com,
  s3-fips.dualstack.<region>.amazonaws.com; .amazonaws.com.cn in the China regions.
A bucket whose name is a valid host label goes in the host (virtual-hosted style); another (dots,
capitals) in the path, as botocore does."""

from __future__ import annotations

import base64
import http.client
import re
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, replace

from supervisor.store.base import TargetError

CONNECT_TIMEOUT = 10
READ_TIMEOUT = 120
TRUE = ("true", "1", "yes")
DNS_BUCKET = re.compile(r"[a-z0-9][a-z0-9-]{1,61}[a-z0-9]")


@dataclass(frozen=True)
class Proxy:
    host: str
    port: int
    auth: str  # the Proxy-Authorization header's value, "" without credentials


@dataclass(frozen=True)
class Endpoint:
    """One resolved place: requests go to scheme://netloc/base/<key>, signed for `region`."""
    scheme: str
    netloc: str
    base: str            # "" (the bucket is in the host) or "/<path>/<bucket>"
    region: str
    aws: bool            # AWS's own host: a region redirect changes the host too
    fips: bool = False
    dualstack: bool = False
    bucket: str = ""
    proxy: Proxy | None = None
    ca_bundle: str = ""

    def in_region(self, region: str) -> Endpoint:
        """The same place signed for another region (and on AWS, that region's host)."""
        if not self.aws:
            return replace(self, region=region)
        host = aws_host(region, self.fips, self.dualstack)
        if self.base:
            return replace(self, region=region, netloc=host)
        return replace(self, region=region, netloc=f"{self.bucket}.{host}")

    def target(self, path_qs: str) -> str:
        """The request line's target: an absolute URI through an http proxy to an http store."""
        if self.proxy is not None and self.scheme == "http":
            return f"http://{self.netloc}{path_qs}"
        return path_qs

    def extra_headers(self) -> dict[str, str]:
        if self.proxy is not None and self.scheme == "http" and self.proxy.auth:
            return {"Proxy-Authorization": self.proxy.auth}
        return {}

    def connect(self) -> http.client.HTTPConnection:
        p = self.proxy
        if self.scheme == "https":
            import ssl

            ctx = ssl.create_default_context(cafile=self.ca_bundle or None)
            if p is None:
                c: http.client.HTTPConnection = http.client.HTTPSConnection(self.netloc, timeout=CONNECT_TIMEOUT,
                                                                            context=ctx)
            else:
                c = http.client.HTTPSConnection(p.host, p.port, timeout=CONNECT_TIMEOUT, context=ctx)
                host, port = _split(self.netloc, 443)
                c.set_tunnel(host, port, headers={"Proxy-Authorization": p.auth} if p.auth else None)
        elif p is None:
            c = http.client.HTTPConnection(self.netloc, timeout=CONNECT_TIMEOUT)
        else:
            c = http.client.HTTPConnection(p.host, p.port, timeout=CONNECT_TIMEOUT)
        c.connect()
        assert c.sock is not None
        c.sock.settimeout(READ_TIMEOUT)
        return c


def aws_host(region: str, fips: bool, dualstack: bool) -> str:
    name = ("s3-fips" if fips else "s3") + (".dualstack" if dualstack else "")
    return f"{name}.{region}.amazonaws.com" + (".cn" if region.startswith("cn-") else "")


def _split(netloc: str, default: int) -> tuple[str, int]:
    u = urllib.parse.urlsplit("//" + netloc)
    return u.hostname or netloc, u.port or default


def _flag(env: Mapping[str, str], var: str, config: Mapping[str, object], name: str) -> bool:
    v = env.get(var)
    if v is None:
        v = config.get(name)
    return str(v or "").strip().lower() in TRUE


def resolve(endpoint_url: str, bucket: str, region: str, env: Mapping[str, str],
            config: Mapping[str, object]) -> Endpoint:
    """The endpoint for a bucket: `endpoint_url` (sync.endpoint_url) first, then the environment's,
    then the profile's (`config`: the profile's settings, empty for static keys)."""
    s3cfg = config.get("s3") if isinstance(config.get("s3"), dict) else {}
    assert isinstance(s3cfg, dict)
    if "services" in config:
        raise TargetError(f"the AWS profile's `services = {config['services']}` (per-service endpoints) is not "
                          "supported: set sync.endpoint_url")
    if str(s3cfg.get("use_accelerate_endpoint", "")).lower() in TRUE:
        raise TargetError("the AWS profile's s3 use_accelerate_endpoint is not supported: set sync.endpoint_url "
                          "to the accelerate host")
    ignore_env = str(env.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "")).lower() in TRUE
    url, where = endpoint_url, "sync.endpoint_url"
    if not url and not ignore_env:
        for var in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
            if env.get(var):
                url, where = env[var], var
                break
        else:
            if config.get("endpoint_url"):
                url, where = str(config["endpoint_url"]), "the AWS profile's endpoint_url"
    fips = _flag(env, "AWS_USE_FIPS_ENDPOINT", config, "use_fips_endpoint")
    dual = _flag(env, "AWS_USE_DUALSTACK_ENDPOINT", config, "use_dualstack_endpoint") or \
        str(s3cfg.get("use_dualstack_endpoint", "")).lower() in TRUE
    path_style = str(s3cfg.get("addressing_style", "")).lower() == "path"
    ca = env.get("AWS_CA_BUNDLE") or str(config.get("ca_bundle") or "")
    if url:
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname or u.query or u.fragment:
            raise TargetError(f"{where} = {url}: not an http(s) URL of a store")
        base = u.path.rstrip("/") + "/" + bucket  # path style: a store's host names no bucket
        ep = Endpoint(u.scheme, u.netloc, base, region, aws=False, bucket=bucket, ca_bundle=ca)
    else:
        host = aws_host(region, fips, dual)
        if DNS_BUCKET.fullmatch(bucket) and not path_style:
            ep = Endpoint("https", f"{bucket}.{host}", "", region, True, fips, dual, bucket, ca_bundle=ca)
        else:
            ep = Endpoint("https", host, "/" + bucket, region, True, fips, dual, bucket, ca_bundle=ca)
    return replace(ep, proxy=proxy_for(ep.scheme, _split(ep.netloc, 443)[0], env))


def proxy_for(scheme: str, host: str, env: Mapping[str, str]) -> Proxy | None:
    """The proxy botocore would use for this scheme and host (HTTPS_PROXY for https, HTTP_PROXY
    for http, NO_PROXY's hosts and domains going direct); ALL_PROXY is not read, as botocore does not."""
    names = ("HTTPS_PROXY", "https_proxy") if scheme == "https" else ("HTTP_PROXY", "http_proxy")
    url = next((env[n] for n in names if env.get(n)), "")
    if not url:
        return None
    no = env.get("NO_PROXY") or env.get("no_proxy") or ""
    if no and urllib.request.proxy_bypass_environment(host, {"no": no}):
        return None
    if "://" not in url:
        url = "http://" + url
    u = urllib.parse.urlsplit(url)
    if u.scheme != "http" or not u.hostname:
        raise TargetError(f"{names[0]} = {u.scheme}://{u.hostname}: only an http:// proxy is supported "
                          "(https to the store goes through it in a CONNECT tunnel)")
    auth = ""
    if u.username is not None:
        pair = f"{urllib.parse.unquote(u.username)}:{urllib.parse.unquote(u.password or '')}"
        auth = "Basic " + base64.b64encode(pair.encode()).decode()
    return Proxy(u.hostname, u.port or 80, auth)


def region_of(cfg_region: str, env: Mapping[str, str], config: Mapping[str, object]) -> str:
    return (cfg_region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or str(config.get("region") or "")
            or "us-east-1")


__all__ = ["Endpoint", "Proxy", "aws_host", "proxy_for", "region_of", "resolve"]
