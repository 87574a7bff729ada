"""A real S3 API for the tests: moto's server mode (moto 5.2.1) on a free 127.0.0.1 port.

The processes of a test reach it the way operators reach theirs, through the AWS SDK's own variables
(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL). Every request the server answers is one
line of its log: `requests()` counts them.

moto checks credentials only when told to (INITIAL_NO_AUTH_ACTION_COUNT: that many requests go
unchecked, every later one is checked against the IAM users it knows). With `auth=True` the first
three requests make a user allowed s3:* and its access key. Found here: moto 5.2.1 then refuses every
request s3fs 2026.9.0 (aiobotocore 3.10) signs with that key (SignatureDoesNotMatch) while boto3's
pass, so `auth=True` serves the "store refuses the credentials" case only; the flow runs with auth off.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from regen_service.localproc import free_port, spawn, stop, wait_http

BUCKET = "regen-test"
_REQUEST = re.compile(r'"(GET|PUT|POST|HEAD|DELETE) (\S+) HTTP/1\.1" (\d+)')


@dataclass
class S3Server:
    url: str
    env: dict[str, str]
    log: Path

    def requests(self, since: int = 0) -> list[tuple[str, str, int]]:
        """(method, path, status) of every request answered, from log byte offset `since`."""
        text = self.log.read_bytes()[since:].decode(errors="replace")
        return [(m[1], m[2], int(m[3])) for m in _REQUEST.finditer(text)]

    def offset(self) -> int:
        return self.log.stat().st_size

    def fs(self):
        """An s3fs filesystem on this server with the test user's key, for reading back."""
        import s3fs

        return s3fs.S3FileSystem(
            key=self.env["AWS_ACCESS_KEY_ID"], secret=self.env["AWS_SECRET_ACCESS_KEY"],
            client_kwargs={"endpoint_url": self.url, "region_name": "us-east-1"}, skip_instance_cache=True,
        )  # fmt: skip


@contextlib.contextmanager
def moto_s3(tmp_path: Path, auth: bool = False) -> Iterator[S3Server]:
    import boto3

    port = free_port()
    log = tmp_path / f"moto-{port}.log"
    cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    proc = spawn(cmd, env={"INITIAL_NO_AUTH_ACTION_COUNT": "3"} if auth else None, log=log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/moto-api/", timeout_s=60)
        key = {"AccessKeyId": "regen-test-key", "SecretAccessKey": "regen-test-secret"}
        if auth:
            boot = {"aws_access_key_id": "boot", "aws_secret_access_key": "boot"}
            iam = boto3.client("iam", endpoint_url=url, region_name="us-east-1", **boot)
            iam.create_user(UserName="regen")
            allow = {"Effect": "Allow", "Action": "s3:*", "Resource": "*"}
            policy = json.dumps({"Version": "2012-10-17", "Statement": [allow]})
            iam.put_user_policy(UserName="regen", PolicyName="s3", PolicyDocument=policy)
            key = iam.create_access_key(UserName="regen")["AccessKey"]
        env = {
            "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
            "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
            "AWS_ENDPOINT_URL": url,
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        creds = {
            "aws_access_key_id": env["AWS_ACCESS_KEY_ID"],
            "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
        }
        boto3.client("s3", endpoint_url=url, region_name="us-east-1", **creds).create_bucket(Bucket=BUCKET)
        yield S3Server(url, env, log)
    finally:
        stop(proc)
