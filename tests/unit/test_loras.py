"""The LoRA library on a recording stand-in pipeline: names checked before any file is touched,
resolution inside the directory only, loading once per file version (a changed file again), the
least recently used adapter evicted unless in use, activation only on change, and a file that
fails to load leaving nothing behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from handler.adapters.library import EntryError, valid_name
from handler.adapters.loras import LoraLibrary


class RecordingPipeline:
    """What the library calls of a diffusers pipeline, recorded; prompts a failure by file content."""

    def __init__(self) -> None:
        self.adapters: list[str] = []
        self.calls: list[tuple] = []

    def load_lora_weights(self, state_dict: dict, adapter_name: str) -> None:
        self.calls.append(("load", adapter_name))
        if "other_model" in state_dict:  # no key matches a layer: diffusers warns and registers nothing
            return
        self.adapters.append(adapter_name)  # registered before the shapes are checked, as PEFT does
        if "broken" in state_dict:
            raise RuntimeError("size mismatch for lora_A")

    def get_list_adapters(self) -> dict[str, list[str]]:
        return {"unet": list(self.adapters)}

    def delete_adapters(self, name: str) -> None:
        self.calls.append(("delete", name))
        self.adapters.remove(name)

    def set_adapters(self, names: list[str], weights: list[float]) -> None:
        self.calls.append(("set", tuple(names), tuple(weights)))
        if any(weight == 13 for weight in weights):
            raise ValueError("the set cannot be activated")

    def enable_lora(self) -> None:
        self.calls.append(("enable",))

    def disable_lora(self) -> None:
        self.calls.append(("disable",))


def write(directory: Path, name: str, key: str = "lora_A", size: int = 2) -> Path:
    path = directory / f"{name}.safetensors"
    save_file({key: torch.zeros(size)}, path)
    return path


@pytest.fixture
def library(tmp_path) -> LoraLibrary:
    for name in ("outline", "purple", "thick"):
        write(tmp_path, name)
    return LoraLibrary(RecordingPipeline(), torch.nn.Module(), tmp_path, max_loaded=2)


@pytest.mark.parametrize("name", ["outline", "purple-v2", "a_b.c", "X" * 64])
def test_valid_names_are_file_stems(name):
    assert valid_name(name)


@pytest.mark.parametrize("name", ["", "../outline", "a/b", "/etc/passwd", "a..b", ".hidden", "X" * 65, "a b", "c:\\x"])
def test_paths_and_odd_names_are_not_names(name):
    assert not valid_name(name)


def test_a_bad_name_is_refused_before_any_file_is_touched(library, monkeypatch):
    monkeypatch.setattr(Path, "is_file", lambda self: pytest.fail(f"touched {self}"))
    with pytest.raises(EntryError) as caught:
        library.resolve("../outline")
    assert caught.value.rule == "lora_name"


def test_unknown_names_list_what_there_is(library):
    with pytest.raises(EntryError) as caught:
        library.resolve("nope")
    assert caught.value.rule == "unknown_lora" and "outline, purple, thick" in str(caught.value)


def test_a_symlink_out_of_the_directory_is_not_a_lora(library, tmp_path_factory):
    outside = write(tmp_path_factory.mktemp("outside"), "secret")
    assert library.directory is not None
    (library.directory / "escape.safetensors").symlink_to(outside)
    assert "escape" not in [file.name for file in library.available()]
    with pytest.raises(EntryError):
        library.resolve("escape")


def test_without_a_directory_loras_are_off():
    with pytest.raises(EntryError) as caught:
        LoraLibrary(RecordingPipeline(), torch.nn.Module(), None, 2).resolve("outline")
    assert caught.value.rule == "loras_disabled"


def test_an_adapter_is_loaded_once_and_again_when_its_file_changes(library):
    first = library.acquire([("outline", 0.5)], set())
    assert library.acquire([("outline", 1.0)], set()) == ((first[0][0], 1.0),)
    assert [call for call in library.pipeline.calls if call[0] == "load"] == [("load", first[0][0])]
    assert library.directory is not None
    path = write(library.directory, "outline", size=3)
    os.utime(path, ns=(1, 1))
    ((changed, _),) = library.acquire([("outline", 1.0)], set())
    assert changed != first[0][0] and library.pipeline.adapters == [first[0][0], changed]


def test_the_least_recently_used_adapter_is_evicted_unless_in_use(library):
    ((outline, _),) = library.acquire([("outline", 1.0)], set())
    ((purple, _),) = library.acquire([("purple", 1.0)], set())
    library.acquire([("thick", 1.0)], in_use={outline})  # outline is older but held by a job in flight
    assert purple not in library.pipeline.adapters and outline in library.pipeline.adapters
    assert library.loaded == 2
    library.acquire([("purple", 1.0)], set())
    assert outline not in library.pipeline.adapters and library.loaded == 2


def test_a_file_that_fails_to_load_leaves_no_adapter_behind(library):
    assert library.directory is not None
    write(library.directory, "wrong-family", key="broken")
    with pytest.raises(EntryError) as caught:
        library.acquire([("wrong-family", 1.0)], set())
    assert caught.value.rule == "lora_unloadable" and "size mismatch" in str(caught.value)
    assert library.pipeline.adapters == [] and library.loaded == 0
    (library.directory / "corrupt.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(EntryError) as caught:
        library.acquire([("corrupt", 1.0)], set())
    assert caught.value.rule == "lora_unloadable"


def test_a_lora_no_layer_of_the_model_matches_is_refused(library):
    assert library.directory is not None
    write(library.directory, "sd3-lora", key="other_model")
    with pytest.raises(EntryError) as caught:
        library.acquire([("sd3-lora", 1.0)], set())
    assert caught.value.rule == "lora_unloadable" and "no layer of this model" in str(caught.value)
    assert library.loaded == 0


def test_a_failed_activation_forgets_what_is_active(library):
    adapters = library.acquire([("outline", 13.0)], set())
    library.activate(())
    library.pipeline.calls.clear()
    with pytest.raises(ValueError):
        library.activate(adapters)
    library.activate(())  # the LoRA layers were enabled before the failure: they must be disabled again
    assert library.pipeline.calls[-1] == ("disable",)


def test_loras_are_off_with_a_reason_and_an_unreadable_directory_lists_none(library, tmp_path):
    off = LoraLibrary(RecordingPipeline(), torch.nn.Module(), tmp_path, 2, off_because="sequential CPU offload")
    with pytest.raises(EntryError) as caught:
        off.resolve("outline")
    assert caught.value.rule == "loras_disabled" and "sequential CPU offload" in str(caught.value)
    assert off.available() == []
    assert LoraLibrary(RecordingPipeline(), torch.nn.Module(), tmp_path / "missing", 2).available() == []


def test_activation_sets_adapters_only_when_the_set_changes(library):
    adapters = library.acquire([("outline", 0.5), ("purple", -1.0)], set())
    library.pipeline.calls.clear()
    library.activate(adapters)
    library.activate(adapters)
    library.activate(())
    library.activate(())
    names = tuple(adapter for adapter, _ in adapters)
    assert library.pipeline.calls == [("enable",), ("set", names, (0.5, -1.0)), ("disable",)]
