"""Translate the s3fs ``storage_options`` featstore accepts into an obstore ``S3Store`` config.

:func:`plan` returns None for anything it cannot translate faithfully (a custom session,
requester pays, SSE-C, an endpoint or CA bundle from the environment or a config file, the
adaptive retry mode, ...): those stores keep reading through s3fs. Credentials, region and the
retry budget are resolved by botocore exactly as s3fs resolves them (environment, profile,
config file, role), so both clients sign as the same principal and retry as often.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from featstore.errors import StoreUnavailable
from featstore.storage._base import StorageOptions

if TYPE_CHECKING:  # obstore's own types (not importable at runtime), botocore's session
    from botocore.session import Session
    from fsspec import AbstractFileSystem
    from obstore.store import BackoffConfig, ClientConfig, S3Config, S3Credential

#: ``FEATSTORE_S3_CLIENT``: "obstore" (default where it translates) or "s3fs" (always s3fs).
CLIENT_ENV = "FEATSTORE_S3_CLIENT"
#: Options that change nothing a GET does (s3fs's caches, upload sizes, featstore's own).
_NEUTRAL = frozenset({"max_concurrency", "use_listings_cache", "listings_expiry_time", "max_paths",
                      "skip_instance_cache", "default_block_size", "default_fill_cache",
                      "default_cache_type", "fixed_upload_size", "cache_regions"})
_FALSE_ONLY = frozenset({"requester_pays", "version_aware", "asynchronous"})
_CONFIG_KEYS = frozenset({"retries", "read_timeout", "connect_timeout", "max_pool_connections",
                          "region_name", "signature_version", "s3"})
#: Environment and profile settings botocore applies that this translation does not: a store
#: with one of them set keeps reading through s3fs.
_UNTRANSLATED_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_USE_FIPS_ENDPOINT",
                     "AWS_USE_DUALSTACK_ENDPOINT", "AWS_S3_US_EAST_1_REGIONAL_ENDPOINT")
_UNTRANSLATED_PROFILE = frozenset({"endpoint_url", "services", "s3", "ca_bundle", "use_fips_endpoint",
                                   "use_dualstack_endpoint"})
#: botocore's connect and read timeouts (seconds) when the user sets none.
BOTOCORE_TIMEOUT = 60
#: Backoff between attempts: about botocore's (random up to 1, 2, 4, 8 s, at most 20 s).
BACKOFF: BackoffConfig = {"init_backoff": timedelta(seconds=0.5), "max_backoff": timedelta(seconds=20), "base": 2}


@dataclass(frozen=True)
class Plan:
    """What a process needs to build its client; secrets hidden from the repr."""

    bucket: str
    config: S3Config = field(repr=False)
    client_options: ClientConfig
    attempts: int
    session: Session | None = field(repr=False, default=None)  # credentials from botocore's chain
    secrets: tuple[str, ...] = field(repr=False, default=())


def plan(url: str, options: StorageOptions, fs: AbstractFileSystem | None = None) -> Plan | None:
    """obstore's configuration for reads of ``url`` with s3fs's ``options``, or None where a
    faithful translation is not possible (or ``FEATSTORE_S3_CLIENT=s3fs``)."""
    choice = os.environ.get(CLIENT_ENV, "obstore").strip().lower() or "obstore"
    if choice not in ("obstore", "s3fs"):
        raise StoreUnavailable(f"{CLIENT_ENV}={choice!r}: use 'obstore' (the default) or 's3fs'.")
    if choice == "s3fs":
        return None
    try:
        import botocore.session
        import obstore  # noqa: F401 - only its presence is checked here
    except ImportError:
        return None
    opts = dict(options)
    client = dict(opts.pop("client_kwargs", None) or {})
    conf = dict(opts.pop("config_kwargs", None) or {})
    profile = opts.pop("profile", None)
    key = opts.pop("key", None) or opts.pop("username", None)  # s3fs's aliases
    secret = opts.pop("secret", None) or opts.pop("password", None)
    token, anon = opts.pop("token", None), bool(opts.pop("anon", False))
    endpoint = opts.pop("endpoint_url", None) or client.pop("endpoint_url", None)
    region = client.pop("region_name", None) or conf.pop("region_name", None)
    use_ssl = opts.pop("use_ssl", True)
    if any(opts.pop(k, False) for k in _FALSE_ONLY) or opts.pop("s3_additional_kwargs", None):
        return None
    for k in _NEUTRAL:
        opts.pop(k, None)
    addressing = (conf.pop("s3", None) or {}).copy()
    style = addressing.pop("addressing_style", "auto")
    if opts or client or set(conf) - _CONFIG_KEYS or addressing or style not in ("auto", "path", "virtual") \
            or conf.get("signature_version", "s3v4") != "s3v4" or bool(key) != bool(secret):
        return None  # a custom session, a CA bundle, proxies, another signer, ...: not translated
    session = botocore.session.Session(profile=profile)
    if _UNTRANSLATED_PROFILE & set(session.get_scoped_config()):
        return None
    if any(os.environ.get(k) for k in _UNTRANSLATED_ENV):
        return None
    attempts = _attempts(conf.get("retries"), session)
    if attempts is None:
        return None
    bucket = url.split("://", 1)[-1].split("/", 1)[0]
    if endpoint is None:  # AWS: botocore follows a bucket's region; obstore must be told it
        region = _bucket_region(fs, bucket)
        if region is None:
            return None
        endpoint = f"https://s3.{region}.amazonaws.com"
        if style != "path" and "." not in bucket:
            endpoint = f"https://{bucket}.s3.{region}.amazonaws.com"
    elif not use_ssl and endpoint.startswith("https://"):
        endpoint = "http://" + endpoint[len("https://"):]
    if endpoint.startswith("https://") and os.environ.get("AWS_CA_BUNDLE"):
        return None  # botocore's CA bundle replaces the system roots; obstore's would only add
    cfg: S3Config = {"endpoint": endpoint, "region": region or session.get_config_variable("region")
                           or "us-east-1", "virtual_hosted_style_request": endpoint.startswith(f"https://{bucket}."),
                           "skip_signature": anon, "request_payer": False}
    if key and not anon:
        cfg["access_key_id"], cfg["secret_access_key"] = key, secret
        if token:
            cfg["session_token"] = token
    read = conf.get("read_timeout", BOTOCORE_TIMEOUT)
    connect = conf.get("connect_timeout", BOTOCORE_TIMEOUT)
    client_options: ClientConfig = {"allow_http": endpoint.startswith("http://"),
                                    "connect_timeout": timedelta(seconds=connect),
                                    "read_timeout": timedelta(seconds=read),
                                    # botocore bounds no whole request: a big object on a slow link must not time out
                                    "timeout": timedelta(hours=24)}
    return Plan(bucket, cfg, client_options, attempts, None if key or anon else session,
                tuple(s for s in (key, secret, token) if s))


def _attempts(retries: Mapping[str, int | str] | None, session: Session) -> int | None:
    """Total attempts per request as botocore counts them (client config, then AWS_MAX_ATTEMPTS
    or the profile, then the mode's default); None for the adaptive mode (client-side rate
    limiting: not translated)."""
    retries = dict(retries or {})
    mode = retries.get("mode") or session.get_config_variable("retry_mode") or "legacy"
    if mode not in ("standard", "legacy"):
        return None
    if "total_max_attempts" in retries:
        return max(1, int(retries["total_max_attempts"]))
    if "max_attempts" in retries:  # botocore's client config: retries, not attempts
        return max(1, int(retries["max_attempts"]) + 1)
    configured = session.get_config_variable("max_attempts")
    return max(1, int(configured)) if configured is not None else (3 if mode == "standard" else 5)


def _bucket_region(fs: AbstractFileSystem | None, bucket: str) -> str | None:
    """The bucket's region, asked through s3fs (botocore follows the redirect and the header
    names the region even when the answer is 403); None when it cannot be told."""
    if fs is None:
        return None
    from fsspec.asyn import sync

    try:
        meta = sync(fs.loop, fs._call_s3, "head_bucket", Bucket=bucket)["ResponseMetadata"]
    except Exception as exc:  # noqa: BLE001 - ClientError with a response, or no region at all
        meta = (getattr(exc, "response", None) or {}).get("ResponseMetadata", {})
    return (meta.get("HTTPHeaders") or {}).get("x-amz-bucket-region")


def credentials(session: Session) -> Callable[[], S3Credential]:
    """obstore's credential callback over botocore's chain (the same chain s3fs uses)."""

    def provide() -> S3Credential:
        creds = session.get_credentials()
        if creds is None:
            raise StoreUnavailable("no S3 credentials found: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                                   "AWS_PROFILE or a role (see docs/s3.md, section 'Credentials').")
        frozen = creds.get_frozen_credentials()
        expiry: datetime | None = getattr(creds, "_expiry_time", None)  # refreshable ones expire
        return {"access_key_id": frozen.access_key, "secret_access_key": frozen.secret_key,
                "token": frozen.token, "expires_at": expiry - timedelta(minutes=5) if expiry else None}

    return provide
