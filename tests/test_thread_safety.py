"""Registration, overrides and selection from 16 threads at once end in a consistent state."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from app.backends import (
    MLAPrefillBackendEnum,
    explain_mla_prefill_selection,
    get_mla_prefill_backend,
    override_mla_prefill_backend,
    register_mla_prefill_backend,
)
from app.backends.prefill.torch_sdpa import TorchSDPABackend
from app.config import AttentionConfig, EngineConfig, ModelConfig
from app.containers import create_container, use_container
from app.platforms import CpuPlatform

THREADS = 16
SECONDS = 3.0


def _subclasses(prefix: str, n: int) -> list[type[TorchSDPABackend]]:
    return [type(f"{prefix}{i}", (TorchSDPABackend,), {}) for i in range(n)]


SCOPED = _subclasses("Scoped", THREADS)
PERMANENT = _subclasses("Permanent", THREADS)
CONFIG = EngineConfig(model=ModelConfig(dtype=torch.float32))


@pytest.mark.slow
def test_sixteen_threads_end_consistent() -> None:
    shared = create_container(CONFIG, platform=CpuPlatform())
    errors: list[BaseException] = []
    deadline = time.monotonic() + SECONDS
    allowed = {TorchSDPABackend, *SCOPED}
    start = threading.Barrier(THREADS)

    def worker(i: int) -> None:
        rng = random.Random(i)
        try:
            start.wait(timeout=30)
            with use_container(shared):
                while time.monotonic() < deadline:
                    op = rng.randrange(5)
                    if op == 0:
                        with override_mla_prefill_backend(MLAPrefillBackendEnum.TORCH_SDPA,
                                                          SCOPED[i]):
                            chosen = get_mla_prefill_backend(CONFIG)
                            time.sleep(rng.random() * 1e-3)  # let other scopes interleave
                            if chosen not in allowed:
                                raise AssertionError(f"selected {chosen}")
                    elif op == 1:
                        register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, PERMANENT[i])
                    elif op == 2:
                        if get_mla_prefill_backend(CONFIG) not in allowed:
                            raise AssertionError("unexpected selection")
                    elif op == 3:
                        explain_mla_prefill_selection(CONFIG)
                    else:
                        own = create_container(CONFIG, platform=CpuPlatform())
                        with use_container(own):
                            register_mla_prefill_backend(MLAPrefillBackendEnum.TORCH_SDPA,
                                                         PERMANENT[i])
                            if get_mla_prefill_backend(CONFIG) is not PERMANENT[i]:
                                raise AssertionError("own container saw another override")
        except BaseException as exc:  # collected and re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    with use_container(shared):
        # Every scoped override was undone, whatever the interleaving.
        assert not MLAPrefillBackendEnum.TORCH_SDPA.is_overridden()
        assert get_mla_prefill_backend(CONFIG) is TorchSDPABackend
        # The permanent registrations left CUSTOM on one of them, and selection agrees.
        custom = MLAPrefillBackendEnum.CUSTOM.get_class()
        assert custom in PERMANENT
        forced = EngineConfig(model=CONFIG.model,
                              attention=AttentionConfig(mla_prefill_backend="CUSTOM"))
        assert get_mla_prefill_backend(forced) is custom
