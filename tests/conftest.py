"""Shared fixtures: real RabbitMQ and Redis (never mocks), unique names per test,
tokenizers made on the spot (nothing is downloaded)."""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.real_tokenizers import sentencepiece_folder, tekken_folder
from tests.services import ServiceUrls, service_urls
from trtllm_worker.config import Settings
from trtllm_worker.contract.queues import cancel_exchange_name, dead_queue_name
from trtllm_worker.tokenizer import builtin_byte_tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, hello tokenizers! Streaming text one token at a time.",
    "日本語のテキストも正しく扱えること。東京は日本の首都です。",
    "中文文本测试：你好，世界。",
    "Emoji: 😀 😃 😄 👍🏽 👨‍👩‍👧‍👦 🇫🇷 and more 🎉.",
    "Combining marks: é (e\u0301), ñ (n\u0303), Å (A\u030a), ḍ̇ and Z̤͔ͧ̑̓.",
    "Numbers 0123456789 and symbols <>[]{}()=+-*/\\|~`'\"",
]


@pytest.fixture(scope="session")
def services() -> Iterator[ServiceUrls]:
    with service_urls() as urls:
        yield urls


@pytest.fixture
def names() -> dict[str, str]:
    """A queue name and a stream prefix no other test uses."""
    suffix = uuid.uuid4().hex[:12]
    return {"queue": f"test-{suffix}", "stream_prefix": f"test:{suffix}:"}


async def _delete_topology(amqp_url: str, queue: str) -> None:
    import aio_pika

    connection = await aio_pika.connect(amqp_url, timeout=10)
    try:
        channel = await connection.channel()
        for name in (queue, dead_queue_name(queue)):
            await channel.queue_delete(name)
        await channel.exchange_delete(cancel_exchange_name(queue))
    finally:
        await connection.close()


@pytest.fixture(autouse=True)
def delete_test_queues(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every test that named its own queue, delete that queue, its dead-letter
    queue and its cancel exchange from the shared RabbitMQ, whoever declared them (a
    worker started without the `amqp_channel` fixture declares them too). Left behind,
    they pile up run after run until the broker runs out of file handles and every
    test hangs: that is what failed CI once."""
    if "names" not in request.fixturenames:
        yield
        return
    # taken now: by teardown, the fixtures this one did not ask for are gone
    names: dict[str, str] = request.getfixturevalue("names")
    amqp_url: str = request.getfixturevalue("services").amqp
    yield
    # in a thread of its own: the test's event loop may be closed or still running
    failure: list[BaseException] = []

    def delete() -> None:
        try:
            asyncio.run(_delete_topology(amqp_url, names["queue"]))
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=delete, name="delete-test-queues")
    thread.start()
    thread.join(30)
    if thread.is_alive() or failure:
        reason = repr(failure[0]) if failure else "no answer in 30 s"
        pytest.fail(f"could not delete the test's queue {names['queue']}: {reason}")


@pytest.fixture
def make_settings(services: ServiceUrls, names: dict[str, str]) -> Any:
    """Settings for a worker of this test: its own queue and prefix, any free HTTP port."""

    def make(**overrides: Any) -> Settings:
        values: dict[str, Any] = {
            "amqp_url": services.amqp,
            "redis_url": services.redis,
            "queue": names["queue"],
            "stream_prefix": names["stream_prefix"],
            "http_port": 0,
            "http_host": "127.0.0.1",
            "drain_timeout_s": 5,
        }
        values.update(overrides)
        return Settings(_env_file=None, **values)

    return make


@pytest.fixture(scope="session")
def byte_tokenizer() -> Tokenizer:
    return builtin_byte_tokenizer()


@pytest.fixture(scope="session")
def bpe_tokenizer() -> Tokenizer:
    """A small byte-level BPE trained here: merges make multi-byte characters split
    across tokens in varied ways."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    return tokenizer


@pytest.fixture(scope="session")
def metaspace_tokenizer() -> Tokenizer:
    """A SentencePiece-style BPE (Metaspace, byte fallback `<0xXX>` tokens): characters
    it has not seen decode from several byte tokens, and its decoder drops the leading
    space of a sequence, which is what priming the detokenizer is for."""
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<unk>", "<s>", "</s>"],
        show_progress=False,
        limit_alphabet=60,
    )
    trained.train_from_iterator(CORPUS * 20, trainer)
    model = json.loads(trained.to_str())["model"]
    vocab: dict[str, int] = dict(model["vocab"])
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges: list[tuple[str, str]] = [
        (m.split(" ")[0], m.split(" ")[1]) if isinstance(m, str) else (m[0], m[1])
        for m in model["merges"]
    ]
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>")
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tokenizer


@pytest.fixture
def tokenizer_dir(tmp_path: Path, bpe_tokenizer: Tokenizer) -> Path:
    """A model folder as a Hugging Face checkpoint has it (tokenizer files only)."""
    bpe_tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    return tmp_path


@pytest.fixture(scope="session")
def sentencepiece_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Mistral 7B's SentencePiece tokenizer (from mistral-common) as a model folder."""
    return sentencepiece_folder(tmp_path_factory.mktemp("real"))


@pytest.fixture(scope="session")
def tekken_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Mistral NeMo's Tekken tokenizer (from mistral-common) as a model folder."""
    return tekken_folder(tmp_path_factory.mktemp("real"))
