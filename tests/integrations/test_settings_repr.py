"""Engine settings never show a shared tier's password in their repr (logs print them)."""

from kvoffload.integrations.sglang.settings import REMOTE_URL
from kvoffload.integrations.sglang.settings import parse_settings as parse_sglang
from kvoffload.integrations.vllm.settings import REMOTE_URL_KEY
from kvoffload.integrations.vllm.settings import parse_settings as parse_vllm

URL = "redis://user:s3cr%2Fet@127.0.0.1:6379/0"


def test_vllm_settings_repr_hides_the_remote_url() -> None:
    settings = parse_vllm({"cpu_bytes_to_use": 1 << 20, REMOTE_URL_KEY: URL})
    assert settings.remote_url == URL
    assert "s3cr" not in repr(settings)


def test_sglang_settings_repr_hides_the_remote_url() -> None:
    settings = parse_sglang({REMOTE_URL: URL})
    assert settings.remote_url == URL
    assert "s3cr" not in repr(settings)
