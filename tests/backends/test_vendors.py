"""Vendor facts are written once (``app.backends.vendors``) and read by both kinds."""

from __future__ import annotations

import pytest

from app.backends import vendors
from app.backends.decode import flashinfer_mla, tokenspeed_mla
from app.backends.prefill import flash_attn, flashinfer, trtllm_ragged
from app.backends.prefill import tokenspeed_mla as tokenspeed_prefill


def test_both_kinds_read_one_set_of_facts_per_package() -> None:
    for cls in (flashinfer.FlashInferPrefillBackend, trtllm_ragged.TrtllmRaggedPrefillBackend,
                flashinfer_mla.FlashInferMLADecodeBackend):
        assert cls.install_hint is vendors.FLASHINFER_INSTALL_HINT
        assert cls.kernel_package == vendors.FLASHINFER_PACKAGE
    for cls in (tokenspeed_prefill.TokenSpeedMLAPrefillBackend,
                tokenspeed_mla.TokenSpeedMLADecodeBackend):
        assert cls.install_hint is vendors.TOKENSPEED_INSTALL_HINT
        assert cls.compute_capabilities is vendors.TOKENSPEED_CAPABILITIES
        assert cls.kernel_package == vendors.TOKENSPEED_PACKAGE
    assert flash_attn.FlashAttnPrefillBackend.install_hint is vendors.FLASH_ATTN_INSTALL_HINT
    # the names the modules exported before still hold the same facts
    assert tokenspeed_prefill.SUPPORTED_CAPABILITIES is vendors.TOKENSPEED_CAPABILITIES
    assert flashinfer.INSTALL_HINT is vendors.FLASHINFER_INSTALL_HINT
    assert flashinfer_mla.FlashInferMLAKernels is vendors.FlashInferMLAKernels


def test_one_backends_probe_is_swapped_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokenspeed_mla, "_probe", lambda: None)
    assert not tokenspeed_mla.TokenSpeedMLADecodeBackend.is_available()
    assert tokenspeed_prefill._probe is vendors.probe_tokenspeed_mla   # prefill's untouched
