"""The manager under an admission layer whose tier keeps its own index."""

from kvoffload import block_id_key
from kvoffload.admission import AdmissionLayer, wrap_with_admission
from kvoffload.core.specs import LoadStoreSpec
from kvoffload.managers.admit_all import AdmitAllManager


class _Spec(LoadStoreSpec):
    @staticmethod
    def medium() -> str:
        return "TEST"


def test_admits_every_offer_whole_and_finds_nothing() -> None:
    spec = _Spec()
    manager = AdmitAllManager(spec)
    keys = [block_id_key(i) for i in range(5)]
    assert manager.lookup(keys) == 0
    out = manager.prepare_store(iter(keys))
    assert out is not None
    assert out.keys_to_store == keys and out.evicted_keys == [] and out.store_spec is spec
    assert manager.prepare_load(keys) is spec


def test_under_the_sketch_rule_only_the_layer_decides() -> None:
    layer = wrap_with_admission("sketch", AdmitAllManager(_Spec()), 16)
    assert isinstance(layer, AdmissionLayer)
    keys = [block_id_key(i) for i in range(3)]
    layer.lookup(keys)
    first = layer.prepare_store(keys)
    assert first is not None and first.keys_to_store == []
    layer.lookup(keys)
    second = layer.prepare_store(keys)
    assert second is not None and second.keys_to_store == keys
