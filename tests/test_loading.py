"""Sharded loading (common/loading.py) on 2 CPU ranks: each rank's shards, read from safetensors files on the meta-built
model, are bit for bit those of the whole-model load, which a folder without safetensors files still takes."""

import shutil
import sys

import pytest
import torch
from ray import cloudpickle

from common.worker_group import WorkerGroup
from common.workers import CriticWorker
from common.workers import PolicyWorker

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Shards:
    def shards(self) -> dict[str, torch.Tensor]:
        """This rank's own part of every parameter and buffer, of the model and of its reference."""
        models = {"model": self.model, "reference": getattr(self, "reference", None)}
        return {
            f"{key}.{name}": getattr(t, "to_local", lambda: t)().detach().clone()
            for key, model in models.items()
            if model is not None
            for name, t in [*model.named_parameters(), *model.named_buffers()]
        }

    def tied(self) -> bool:
        base = self.model.get_base_model() if self.lora else self.model
        return base.lm_head.weight is base.model.embed_tokens.weight


class PolicyShards(Shards, PolicyWorker):
    pass


class CriticShards(Shards, CriticWorker):
    pass


@pytest.fixture(scope="module")
def folders(tiny_model, tmp_path_factory):
    """The tiny model (its embeddings tied to its head) as several safetensors files with an index, and as a
    pytorch_model.bin, the folder that takes today's whole-model load."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    assert model.config.tie_word_embeddings
    root = tmp_path_factory.mktemp("loading")
    split, whole = root / "split", root / "bin"
    for folder in (split, whole):
        shutil.copytree(tiny_model, folder, ignore=shutil.ignore_patterns("*.safetensors*"))
    model.save_pretrained(split, max_shard_size="100KB")
    assert (split / "model.safetensors.index.json").is_file()
    torch.save(model.state_dict(), whole / "pytorch_model.bin")
    return str(split), str(whole)


@pytest.mark.parametrize(
    "worker,settings",
    [
        (PolicyShards, {}),
        (PolicyShards, {"lora_rank": 4, "replicate_frozen": False}),
        (PolicyShards, {"lora_rank": 4}),
        (CriticShards, {}),
        (CriticShards, {"lora_rank": 4, "replicate_frozen": False}),
    ],
    ids=["policy", "policy-lora-sharded", "policy-lora-replicated", "critic", "critic-lora"],
)
def test_sharded_load_gives_the_whole_loads_weights_bit_for_bit(cpu_pool, folders, worker, settings):
    """Every parameter and buffer of every rank (the reference's too; the critic's new value head drawn from each
    rank's seed; the LoRA adapter) equals the whole-model load's, bit for bit, and the head stays tied."""
    split, whole = folders
    extra = {"engine": None} if worker is PolicyShards else {}
    shards = {}
    for name, path in (("split", split), ("whole", whole)):
        group = WorkerGroup(worker, cpu_pool, f"load-{name}", model_path=path, seed=3, **extra, **settings)
        try:
            shards[name] = group.broadcast("shards")
            if worker is PolicyShards:
                assert group.broadcast("tied") == [True, True]
        finally:
            group.shutdown()
    for rank, (loaded, expected) in enumerate(zip(shards["split"], shards["whole"])):
        assert loaded.keys() == expected.keys()
        for name, tensor in expected.items():
            assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape, (rank, name)
            assert torch.equal(loaded[name], tensor), (rank, name)
    assert any("lora_A" in name for name in shards["split"][0]) == bool(settings)
