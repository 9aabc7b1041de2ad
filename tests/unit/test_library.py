"""Directories of named entries (``handler.adapters.library``), through the ControlNet and LoRA
libraries: a load makes room first, so memory never holds more than ``max_loaded``; a load that runs
out of device memory is the server's condition (``Busy``: 503), not the request's fault (400); the
twin kinds (files with a suffix, directories with a marker file) list and resolve alike, and a kind
of both (ControlNets) takes a directory or a file of a name, the directory first."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from diffusers import ControlNetModel
from safetensors.torch import save_file

from handler.adapters.controlnets import ControlNetLibrary
from handler.adapters.library import Busy, EntryError
from handler.adapters.loras import LoraLibrary
from handler.config import FamilyRules
from model_making.make_controlnet import write_controlnet
from server.paths import TINY_MODEL_DIRS

NAMES = ("depth", "edges", "pose")


@pytest.fixture(scope="module")
def controlnet_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("controlnets")
    for seed, name in enumerate(NAMES):
        write_controlnet(TINY_MODEL_DIRS["sd1"], directory / name, seed=seed)
    (directory / "no-config").mkdir()
    return directory


def controlnets(directory: Path, max_loaded: int) -> ControlNetLibrary:
    any_unet = SimpleNamespace(
        rules=FamilyRules(),
        controlnet_refusal=lambda config: None,
        controlnet_class=ControlNetModel,
        controlnet_files=True,
        prepare_controlnet=lambda net: net,
    )
    return ControlNetLibrary(any_unet, directory, max_loaded, torch.device("cpu"), torch.float32)  # type: ignore[arg-type]


def test_a_load_makes_room_first_so_memory_never_holds_more_than_max_loaded(controlnet_dir, monkeypatch):
    library = controlnets(controlnet_dir, max_loaded=2)
    held_at_load = []
    load = ControlNetModel.from_pretrained

    def counting(*args, **kwargs):
        held_at_load.append(len(library._nets))
        return load(*args, **kwargs)

    monkeypatch.setattr(ControlNetModel, "from_pretrained", counting)
    (depth,) = library.acquire(["depth"], in_use=())
    library.acquire(["edges"], in_use=())
    library.acquire(["pose"], in_use={depth})  # edges is evicted before pose loads; depth is in use
    assert held_at_load == [0, 1, 1] and library.loaded == 2
    assert library.acquire(["depth"], in_use=()) == [depth], "still loaded: no load"
    assert held_at_load == [0, 1, 1]


def test_out_of_device_memory_while_loading_is_busy_and_leaves_nothing_loaded(controlnet_dir, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    library = controlnets(controlnet_dir, max_loaded=2)
    monkeypatch.setattr(ControlNetModel, "from_pretrained", out_of_memory)
    with pytest.raises(Busy, match="'edges' does not fit in device memory now"):
        library.acquire(["edges"], in_use=())
    assert library.loaded == 0


class OutOfMemoryPipeline:
    """A pipeline whose LoRA load runs out of device memory after registering the adapter."""

    def __init__(self) -> None:
        self.adapters: list[str] = []

    def load_lora_weights(self, state_dict: dict, adapter_name: str) -> None:
        self.adapters.append(adapter_name)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")

    def get_list_adapters(self) -> dict[str, list[str]]:
        return {"unet": list(self.adapters)}

    def delete_adapters(self, name: str) -> None:
        self.adapters.remove(name)


def test_a_lora_load_out_of_device_memory_is_busy_and_leaves_no_adapter_behind(tmp_path):
    save_file({"lora_A": torch.zeros(2)}, tmp_path / "outline.safetensors")
    pipeline = OutOfMemoryPipeline()
    library = LoraLibrary(pipeline, torch.nn.Module(), tmp_path, 2)
    with pytest.raises(Busy, match="LoRA 'outline' does not fit in device memory now"):
        library.acquire([("outline", 1.0)], in_use=())
    assert pipeline.adapters == [] and library.loaded == 0


def test_both_kinds_list_and_resolve_by_name_only_inside_their_directory(controlnet_dir, tmp_path):
    library = controlnets(controlnet_dir, max_loaded=1)
    assert [entry.name for entry in library.available()] == list(NAMES)  # no-config is no ControlNet
    assert library.resolve("pose").path == (controlnet_dir / "pose").resolve()
    save_file({"lora_A": torch.zeros(2)}, tmp_path / "outline.safetensors")
    (tmp_path / "notes.txt").write_text("not a LoRA")
    loras = LoraLibrary(None, torch.nn.Module(), tmp_path, 1)
    assert [entry.describe()["name"] for entry in loras.available()] == ["outline"]
    for library_of, name, rule in [
        (library, "no-config", "unknown_controlnet"),
        (library, "../pose", "controlnet_name"),
        (loras, "notes", "unknown_lora"),
        (loras, "/etc/passwd", "lora_name"),
    ]:
        with pytest.raises(EntryError) as refused:
            library_of.resolve(name)
        assert refused.value.rule == rule, name


def test_a_kind_of_both_lists_files_beside_directories_and_resolves_a_name_to_its_directory_first(tmp_path):
    directory = tmp_path / "controlnets"
    directory.mkdir()
    write_controlnet(TINY_MODEL_DIRS["sd1"], directory / "edges", seed=0)
    save_file({"x": torch.zeros(2)}, directory / "canny.safetensors")
    save_file({"x": torch.zeros(2)}, directory / "edges.safetensors")  # the directory of that name wins
    (directory / "notes.txt").write_text("no ControlNet")
    (directory / "folder.safetensors").mkdir()  # a directory named as a file: its name is all of it
    (directory / "folder.safetensors" / "config.json").write_text("{}")
    library = controlnets(directory, max_loaded=1)
    assert [entry.name for entry in library.available()] == ["canny", "edges", "folder.safetensors"]
    assert library.available()[1].path == (directory / "edges").resolve()
    assert library.resolve("canny").path == (directory / "canny.safetensors").resolve()
    assert library.resolve("edges").path == (directory / "edges").resolve()
    assert library.resolve("folder.safetensors").path == (directory / "folder.safetensors").resolve()
    for name in ("notes", "folder"):
        with pytest.raises(EntryError) as refused:
            library.resolve(name)
        assert refused.value.rule == "unknown_controlnet", name
