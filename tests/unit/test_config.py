"""Handler settings and the shipped configuration files."""

import json
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml
from pydantic import ValidationError

from handler.config import (
    REQUEST_TIMEOUT_SHARE,
    TORCHSERVE_RESPONSE_TIMEOUT,
    FamilyRules,
    HandlerSettings,
    continuous_batching,
)
from server.paths import CONFIG_PROPERTIES, METRICS_CONFIG
from server.properties import (
    EFFECTIVE_CONFIG,
    KEY_FILE,
    bound_to,
    config_on_free_ports,
    free_ports,
    reach,
    reachable,
    read_properties,
    write_properties,
)
from tests.harness.serving import SHIPPED_CONFIG

PROPERTIES = read_properties(CONFIG_PROPERTIES)


def test_shipped_model_config_is_valid_and_batches():
    settings = HandlerSettings.from_model_yaml(SHIPPED_CONFIG)
    assert settings.attention == "sdpa" and settings.dtype == "auto" and settings.safety_checker
    assert "continuousBatching" not in SHIPPED_CONFIG and settings.iteration_budget_ms > 0  # packaging picks
    assert SHIPPED_CONFIG["batchSize"] > 1 and "maxBatchDelay" not in SHIPPED_CONFIG  # packaging picks, per mode
    assert SHIPPED_CONFIG["batchSize"] <= settings.max_images_per_call


def test_continuous_batching_is_refused_with_more_than_one_worker():
    assert continuous_batching({"continuousBatching": True}) and continuous_batching(
        {"continuousBatching": True, "maxWorkers": 1}
    )
    assert not continuous_batching({"continuousBatching": False, "maxWorkers": 4}) and not continuous_batching(None)
    for workers in ({"minWorkers": 2}, {"maxWorkers": 4}):
        with pytest.raises(ValueError, match="one worker per model"):
            continuous_batching({"continuousBatching": True, **workers})


def test_empty_handler_section_gives_defaults():
    torchserve_default = HandlerSettings(request_timeout_s=REQUEST_TIMEOUT_SHARE * TORCHSERVE_RESPONSE_TIMEOUT)
    assert HandlerSettings.from_model_yaml({}) == HandlerSettings.from_model_yaml(None) == torchserve_default


def test_the_request_timeout_defaults_to_its_share_of_the_response_timeout_unless_set():
    assert HandlerSettings.from_model_yaml({"responseTimeout": 300}).request_timeout_s == 270
    assert (
        HandlerSettings.from_model_yaml(
            {"responseTimeout": 300, "handler": {"request_timeout_s": 20}}
        ).request_timeout_s
        == 20
    )
    with pytest.raises(ValidationError):
        HandlerSettings.from_model_yaml({"handler": {"request_timeout_s": 0}})
    with pytest.raises(ValueError, match="must be below responseTimeout 300"):
        HandlerSettings.from_model_yaml({"responseTimeout": 300, "handler": {"request_timeout_s": 300}})


@pytest.mark.parametrize(
    "handler",
    [
        {"dtype": "float8"},
        {"attention": "flash"},
        {"unknown_setting": 1},
        {"limits": {"max_side": 100}},
        {"limits": {"min_side": 512, "max_side": 256}},
        {"defaults": {"num_inference_steps": 200}},
        {"defaults": {"width": 2048}},
        {"defaults": {"width": 1024, "height": 1024}, "limits": {"max_pixels": 65536}},
        {"limits": {"max_images_per_request": 8}, "max_images_per_call": 4},
        {"compile": {"enabled": True, "cache_dir": "relative/cache"}},
        {"compile": {"mode": "fastest"}},
        {"compile": {"backend": "tensorrt"}},
        {"profiler": {"steps": 10, "dir": "relative/profiles"}},
        {"profiler": {"steps": -1}},
        {"profiler": {"min_rows": 0}},
        {"loras": {"slot_design": "dense"}},
        {"decode_stream": "side"},
    ],
)
def test_bad_settings_fail_at_load(handler):
    with pytest.raises(ValidationError):
        HandlerSettings.from_model_yaml({"handler": handler})


def test_the_cudagraphs_backend_refuses_inductors_modes_and_targets_without_the_denoiser_by_name():
    for mode in ("reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"):
        with pytest.raises(ValidationError, match=f"compile.mode {mode} is inductor's; compile.backend cudagraphs"):
            HandlerSettings.from_model_yaml({"handler": {"compile": {"backend": "cudagraphs", "mode": mode}}})
    with pytest.raises(ValidationError, match=r"compile.targets \['vae_decoder'\] names none \(unet or transformer\)"):
        HandlerSettings.from_model_yaml({"handler": {"compile": {"backend": "cudagraphs", "targets": ["vae_decoder"]}}})
    assert HandlerSettings.from_model_yaml({"handler": {"compile": {"backend": "cudagraphs"}}}).compile.backend


@pytest.mark.parametrize("compiled", [{"backend": "cudagraphs"}, {"mode": "reduce-overhead"}, {"mode": "max-autotune"}])
def test_cuda_graphs_refuse_cpu_offload_by_name(compiled):
    """Offloading moves the weights a CUDA graph reads where it recorded them."""
    for offload in ("model", "sequential"):
        handler = {"cpu_offload": offload, "compile": {"enabled": True, **compiled}}
        with pytest.raises(ValidationError, match=f"cpu_offload {offload} moves the denoiser's weights"):
            HandlerSettings.from_model_yaml({"handler": handler})
    HandlerSettings.from_model_yaml({"handler": {"cpu_offload": "model", "compile": {"enabled": True}}})


def test_compile_cache_dir_is_absolute_after_expanding_home_and_variables(monkeypatch):
    monkeypatch.setenv("SD_CACHE", "/srv/cache")
    assert (
        HandlerSettings.model_validate({"compile": {"cache_dir": "${SD_CACHE}/inductor"}}).compile.cache_dir
        == "/srv/cache/inductor"
    )
    assert HandlerSettings.model_validate({"compile": {"cache_dir": "~/inductor"}}).compile.cache_dir == str(
        Path.home() / "inductor"
    )
    with pytest.raises(ValidationError, match="must be an absolute path.*'cache'"):
        HandlerSettings.model_validate({"compile": {"cache_dir": "cache"}})


def test_native_size_fills_unset_default_size_and_is_checked():
    settings = HandlerSettings()
    assert settings.for_model(64, 64).defaults.width == 64
    pinned = HandlerSettings.model_validate({"defaults": {"width": 256, "height": 128}})
    assert (pinned.for_model(64, 64).defaults.width, pinned.for_model(64, 64).defaults.height) == (
        256,
        128,
    )
    with pytest.raises(ValidationError):
        HandlerSettings.model_validate({"limits": {"max_side": 512}}).for_model(1024, 1024)


def test_a_model_gets_its_familys_scheduler_where_the_configured_default_is_not_its_familys():
    sd3 = FamilyRules("SD 3.x", ("flow_match_euler",), "flow_match_euler", 16, "start", max_side=512)
    shipped = HandlerSettings.from_model_yaml(SHIPPED_CONFIG)
    assert shipped.defaults.scheduler == "ddim" and shipped.for_model(64, 64).defaults.scheduler == "ddim"
    assert shipped.for_model(1024, 1024, replace(sd3, max_side=None)).defaults.scheduler == "flow_match_euler"
    turbo = HandlerSettings.model_validate({"defaults": {"num_inference_steps": 4, "guidance_scale": 0}})
    assert turbo.for_model(1024, 1024, replace(sd3, max_side=None)).defaults.model_dump(
        include={"num_inference_steps", "guidance_scale", "scheduler"}
    ) == {"num_inference_steps": 4, "guidance_scale": 0.0, "scheduler": "flow_match_euler"}
    with pytest.raises(
        ValueError, match=r"defaults: .* multiples of 16 and at most 512 for this SD 3.x model \(got 72x64"
    ):
        HandlerSettings.model_validate({"defaults": {"width": 72, "height": 64}}).for_model(64, 64, sd3)
    with pytest.raises(ValueError, match=r"defaults: .*\(got 1024x1024\)"):
        HandlerSettings().for_model(1024, 1024, sd3)
    with pytest.raises(ValueError, match=r"warmup\[1\]: .*\(got 520x512\)"):
        HandlerSettings.model_validate(
            {"warmup": [{"width": 64, "height": 64}, {"width": 520, "height": 512}]}
        ).for_model(64, 64, sd3)


def test_a_default_clip_skip_is_checked_against_the_models_text_encoders():
    settings = HandlerSettings.model_validate({"defaults": {"clip_skip": 2}})
    assert settings.for_model(64, 64).defaults.clip_skip == 2
    sdxl = FamilyRules("SDXL", max_clip_skip=10)
    assert HandlerSettings.model_validate({"defaults": {"clip_skip": 10}}).for_model(64, 64, sdxl)
    with pytest.raises(
        ValueError, match=r"defaults.clip_skip 11 .* this SDXL model's CLIP text encoders .* at most 10"
    ):
        HandlerSettings.model_validate({"defaults": {"clip_skip": 11}}).for_model(64, 64, sdxl)
    with pytest.raises(ValidationError, match="clip_skip"):
        HandlerSettings.model_validate({"defaults": {"clip_skip": -1}})


def test_a_default_guidance_rescale_needs_a_family_whose_pipelines_take_it():
    rescaled = HandlerSettings.model_validate({"defaults": {"guidance_rescale": 0.7}})
    assert rescaled.for_model(64, 64).defaults.guidance_rescale == 0.7
    sd3 = FamilyRules("SD 3.x", ("flow_match_euler",), "flow_match_euler", 16, "start", guidance_rescale=False)
    with pytest.raises(ValueError, match=r"defaults.guidance_rescale 0.7: SD 3.x pipelines have no guidance_rescale"):
        rescaled.for_model(64, 64, sd3)
    with pytest.raises(ValidationError, match="guidance_rescale"):
        HandlerSettings.model_validate({"defaults": {"guidance_rescale": 1.5}})


def test_a_default_skip_guidance_layers_needs_blocks_the_models_transformer_has():
    layers = HandlerSettings.model_validate({"defaults": {"skip_guidance_layers": [7, 8, 9]}})
    sd35 = FamilyRules("SD 3.x", ("flow_match_euler",), "flow_match_euler", 16, "start", transformer_blocks=24)
    assert layers.for_model(64, 64, sd35).defaults.skip_guidance_layers == [7, 8, 9]
    with pytest.raises(ValueError, match=r"skip_guidance_layers \[7, 8, 9\]: SD 1.x models have no skip-layer"):
        layers.for_model(64, 64)
    sd3 = replace(sd35, transformer_blocks=8)
    with pytest.raises(ValueError, match=r"^defaults.skip_guidance_layers names \[8, 9\]: this SD 3.x model's "):
        layers.for_model(64, 64, sd3)  # the request's own message, "transformer has 8 blocks, 0 to 7"
    repeated = HandlerSettings.model_validate({"defaults": {"skip_guidance_layers": [1] * 9}})
    with pytest.raises(ValueError, match=r"skip_guidance_layers lists 9 blocks: this SD 3.x model's transformer has 8"):
        repeated.for_model(64, 64, sd3)
    # diffusers' skip_layer_guidance_scale, which a request given the default blocks takes, within the limit
    with pytest.raises(ValidationError, match=r"outside the configured limits.*skip_layer_guidance_scale 2.8"):
        HandlerSettings.model_validate(
            {"defaults": {"skip_guidance_layers": [7], "guidance_scale": 2}, "limits": {"max_guidance_scale": 2.5}}
        )
    for bad in ([], [-1], "7,8"):
        with pytest.raises(ValidationError, match="skip_guidance_layers"):
            HandlerSettings.model_validate({"defaults": {"skip_guidance_layers": bad}})


def test_model_path_is_relative_to_the_archive_unless_absolute():
    assert HandlerSettings().resolve_model_path("/models/sd") == Path("/models/sd/model")
    assert HandlerSettings(model_path="/weights/sd15").resolve_model_path("/models/sd") == Path("/weights/sd15")


def test_server_binds_loopback_with_auth_on_and_model_api_off():
    for key in ("inference_address", "management_address", "metrics_address"):
        assert PROPERTIES[key].startswith("http://127.0.0.1:")
    assert PROPERTIES["grpc_inference_address"] == PROPERTIES["grpc_management_address"] == "127.0.0.1"
    assert PROPERTIES["disable_token_authorization"] == "false"
    assert PROPERTIES["enable_model_api"] == "false"
    assert PROPERTIES["metrics_mode"] == "prometheus"


def test_response_size_fits_the_largest_allowed_response():
    limits = HandlerSettings.from_model_yaml(SHIPPED_CONFIG).limits
    png_bytes = limits.max_pixels * 3 * 1.01 + 4096  # incompressible RGB plus PNG framing
    base64_bytes = png_bytes * 4 / 3 * limits.max_images_per_request
    assert int(PROPERTIES["max_response_size"]) >= base64_bytes + 64 * 1024
    assert int(PROPERTIES["max_request_size"]) >= 4 * limits.max_prompt_chars * 2 + 4096


def test_metrics_yaml_declares_exactly_the_handler_metrics():
    from handler.metrics import METRICS

    declared = yaml.safe_load(METRICS_CONFIG.read_text())["model_metrics"]
    ours = {
        (item["name"], kind, tuple(item["dimensions"]))
        for kind, items in declared.items()
        for item in items
        if item["name"].startswith("sd_")
    }
    assert ours == {(spec.name, spec.type, tuple(spec.dimensions)) for spec in METRICS}
    assert PROPERTIES["metrics_config"] == "metrics.yaml"


def test_allowed_urls_match_only_archives_in_a_local_model_store():
    import re

    patterns = PROPERTIES["allowed_urls"].split(",")

    def allowed(url: str) -> bool:
        return any(re.fullmatch(pattern, url) for pattern in patterns)

    assert allowed("file:///srv/app/model_store/stable-diffusion.mar")
    for url in (
        "https://example.com/model_store/x.mar",
        "file:///etc/passwd",
        "file:///srv/model_store/../x.mar/y",
        "s3://bucket/model_store/x.mar",
    ):
        assert not allowed(url), url


def test_bind_moves_every_listener_and_clients_reach_all_interfaces_via_loopback():
    bound = bound_to(PROPERTIES, "0.0.0.0")
    assert [bound[key] for key in ("inference_address", "management_address", "metrics_address")] == [
        "http://0.0.0.0:8080",
        "http://0.0.0.0:8081",
        "http://0.0.0.0:8082",
    ]
    assert bound["grpc_inference_address"] == bound["grpc_management_address"] == "0.0.0.0"
    assert {key: value for key, value in bound.items() if "address" not in key} == {
        key: value for key, value in PROPERTIES.items() if "address" not in key
    }
    assert reachable(bound)["inference_address"] == "http://127.0.0.1:8080"
    assert reachable(PROPERTIES) == PROPERTIES


def test_free_ports_are_distinct_and_a_servers_config_takes_six_of_them(tmp_path):
    """Each pick holds its port until all are picked: ports released at once come back (500 picks
    from Linux's ~14,000 bind ports collide with near certainty)."""
    ports = free_ports(500)
    assert len(set(ports)) == 500
    written = read_properties(config_on_free_ports(CONFIG_PROPERTIES, tmp_path, enable_model_api="true"))
    listeners = [urlparse(written[f"{name}_address"]).port for name in ("inference", "management", "metrics")]
    others = [int(written[key]) for key in ("grpc_inference_port", "grpc_management_port", "initial_worker_port")]
    assert len(set(listeners + others)) == 6
    assert written["enable_model_api"] == "true" and Path(written["model_store"]).is_absolute()


def test_a_client_reaches_the_server_in_a_working_directory_with_its_key(tmp_path):
    write_properties(tmp_path / EFFECTIVE_CONFIG, bound_to(PROPERTIES, "0.0.0.0"))
    with pytest.raises(OSError):
        reach(tmp_path)  # no key file yet: the server has not written it
    (tmp_path / KEY_FILE).write_text(json.dumps({"inference": {"key": "abc"}, "management": {"key": "def"}}))
    addresses, headers = reach(tmp_path)
    assert addresses.inference == "http://127.0.0.1:8080" and headers == {"Authorization": "Bearer abc"}
    write_properties(tmp_path / EFFECTIVE_CONFIG, {**PROPERTIES, "disable_token_authorization": "true"})
    assert reach(tmp_path)[1] == {}
