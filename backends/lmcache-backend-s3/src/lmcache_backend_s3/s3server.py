"""A local S3 API server for tests, benchmarks and the demo: moto's server mode in its own
process on 127.0.0.1, with authentication on.

:func:`start_local_s3` starts ``python -m moto.server`` on a free port with
``INITIAL_NO_AUTH_ACTION_COUNT`` set so that the only unauthenticated requests are the
ones made here: creating an IAM user with a policy limited to one bucket, its access key,
and the bucket. Everything else must be signed with that key. moto keeps its data in
memory: pause the process (``SIGSTOP``/``SIGCONT``) to simulate an outage, never restart
it. Needs ``moto[server]`` (a test extra of this distribution).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["LocalS3", "free_port", "local_s3", "start_local_s3"]

#: The unauthenticated requests :func:`start_local_s3` makes (user, policy, key, bucket).
SETUP_REQUESTS = 4


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LocalS3:
    """A running local S3 server and the credentials of its one IAM user."""

    proc: subprocess.Popen[bytes] = field(repr=False)
    endpoint_url: str
    bucket: str
    access_key_id: str = field(repr=False)
    secret_access_key: str = field(repr=False)
    region: str = "us-east-1"

    def env(self, prefix: str = "LMC_S3_") -> dict[str, str]:
        """Environment variables holding the credentials (for ``{$env: ...}`` options)."""
        return {
            f"{prefix}ACCESS_KEY_ID": self.access_key_id,
            f"{prefix}SECRET_ACCESS_KEY": self.secret_access_key,
        }

    def options(self, prefix: str = "", **extra: object) -> dict[str, object]:
        """Options of an ``s3`` tier on this server's bucket under ``prefix``."""
        url = f"s3://{self.bucket}/{prefix}".rstrip("/")
        return {
            "url": url,
            "endpoint_url": self.endpoint_url,
            "region": self.region,
            "access_key_id": self.access_key_id,
            "secret_access_key": self.secret_access_key,
            **extra,
        }

    def client(self) -> object:
        """A boto3 client signed with the user's key (the backend's botocore settings)."""
        import boto3

        from .store_boto import botocore_config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=self.region,
            aws_access_key_id=self.access_key_id,
            aws_secret_access_key=self.secret_access_key,
            config=botocore_config(),
        )

    def pause(self) -> None:
        """Stop the server process (its data stays in memory)."""
        import signal

        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Let a paused server run again."""
        import signal

        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """End the server (its data is gone)."""
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _wait_up(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moto server exited with status {proc.returncode}")
        try:
            # moto's own API: no authentication and not counted as an S3/IAM action
            with urllib.request.urlopen(f"{url}/moto-api/data.json", timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"moto server at {url} did not come up in {timeout} s")


def start_local_s3(bucket: str = "lmcache-test", *, timeout: float = 60.0) -> LocalS3:
    """Start moto's S3 server with authentication on, one bucket and one IAM user."""
    import boto3

    port = free_port()
    env = dict(os.environ)
    env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(SETUP_REQUESTS)
    env.setdefault("MOTO_ALLOW_NONEXISTENT_REGION", "true")
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_up(url, proc, timeout)
        anon = {"aws_access_key_id": "setup", "aws_secret_access_key": "setup"}
        iam = boto3.client("iam", endpoint_url=url, region_name="us-east-1", **anon)
        iam.create_user(UserName="lmcache")
        policy = {
            "Version": "2012-10-17",
            "Statement": [
                # ListBucket on every bucket, as AWS answers a listing of a missing
                # bucket with NoSuchBucket whatever the policy (moto checks it first)
                {"Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": ["arn:aws:s3:::*"]},
                {
                    "Effect": "Allow",
                    "Action": [
                        "s3:GetObject",
                        "s3:PutObject",
                        "s3:DeleteObject",
                        "s3:AbortMultipartUpload",
                    ],
                    "Resource": [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"],
                },
            ],
        }
        iam.put_user_policy(
            UserName="lmcache", PolicyName="lmcache-kv", PolicyDocument=json.dumps(policy)
        )
        key = iam.create_access_key(UserName="lmcache")["AccessKey"]
        s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-1", **anon)
        s3.create_bucket(Bucket=bucket)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return LocalS3(proc, url, bucket, key["AccessKeyId"], key["SecretAccessKey"])


@contextlib.contextmanager
def local_s3(bucket: str = "lmcache-test") -> Iterator[LocalS3]:
    """:func:`start_local_s3` as a context manager (stopped on exit)."""
    server = start_local_s3(bucket)
    try:
        yield server
    finally:
        server.stop()
