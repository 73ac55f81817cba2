import kvoffload

EXPECTED = {
    "LAYOUT_PRESETS",
    "BlockIDsLoadStoreSpec",
    "BlockNotFoundError",
    "BlockNotPinnedError",
    "BlockNotReadyError",
    "BlockStateError",
    "BlockStatus",
    "CPULoadStoreSpec",
    "CPUOffloadingManager",
    "CachePolicy",
    "FilterReusedOffloadingManager",
    "GPULoadStoreSpec",
    "InvalidArgumentError",
    "KVLayout",
    "KVOffloadError",
    "LoadStoreSpec",
    "OffloadKey",
    "OffloadingEvent",
    "OffloadingManager",
    "PrepareStoreOutput",
    "available_policies",
    "block_id_key",
    "build_manager",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "hash_token_blocks",
    "keys_for_tokens",
    "layout_preset",
    "make_offload_key",
    "register_cache_policy",
}


def test_public_names_are_pinned() -> None:
    assert set(kvoffload.__all__) == EXPECTED
    for name in EXPECTED:
        assert getattr(kvoffload, name) is not None


def test_core_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, kvoffload; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
