"""Build the Grafana dashboard JSON (docker/grafana/dashboards/stable-diffusion.json) with the
grafana-foundation-sdk (``make dashboard``, through ``observability.generate``). The JSON is
committed; a test checks it equals what this module builds.

Queries read the recording rules of docker/prometheus/rules/recording.yml where one exists.
"""

from __future__ import annotations

import json

from grafana_foundation_sdk.builders import dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DataSourceRef,
    DynamicConfigValue,
    VariableRefresh,
)

from server.paths import GRAFANA_DIR

OUTPUT = GRAFANA_DIR / "dashboards" / "stable-diffusion.json"
UID = "stable-diffusion"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
MODEL = 'model_name=~"$model"'
GPU_ONLY = "GPU hosts only: TorchServe reports GPU metrics where nvidia-smi runs."


def query(expr: str, legend: str) -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend).datasource(DATASOURCE)


def series_panel(
    title: str, description: str, unit: str, queries: list[prometheus.Dataquery], width: int = 12
) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(width)
        .height(8)
        .fill_opacity(10)
        .min(0)
    )
    for item in queries:
        panel = panel.with_target(item)
    return panel


def latency_panel() -> timeseries.Panel:
    quantiles = [
        query(f"model_name:sd_request_latency_seconds:{name}_5m{{{MODEL}}}", f"{name} {{{{model_name}}}}")
        for name in ("p50", "p95", "p99")
    ]
    sla = query(f"model_name:sd_latency_sla_seconds:max{{{MODEL}}}", "SLA {{model_name}}")
    return series_panel(
        "Request latency p50 / p95 / p99 (SLA dashed)",
        "Handler latency quantiles over 5 minutes, from the SLA-ratio histogram (correct above 10 s). "
        "The dashed red line is the configured SLA (sd_latency_sla_seconds).",
        "s",
        [*quantiles, sla],
    ).override_by_regexp(
        "^SLA.*",
        [
            DynamicConfigValue(id_val="color", value={"mode": "fixed", "fixedColor": "red"}),
            DynamicConfigValue(id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]}),
            DynamicConfigValue(id_val="custom.fillOpacity", value=0),
        ],
    )


def panels() -> list[list[timeseries.Panel | stat.Panel]]:
    """Rows of panels, top to bottom."""
    traffic = [
        series_panel(
            "Request rate",
            "Inference requests per second (TorchServe frontend).",
            "reqps",
            [query(f"model_name:ts_inference_requests:rate5m{{{MODEL}}}", "{{model_name}}")],
        ),
        latency_panel(),
        series_panel(
            "Queue wait",
            "Mean time a request waits in TorchServe's queue before a worker admits it (Little's law: TorchServe's "
            "end-to-end latency less the handler's, in both batching modes).",
            "s",
            [query(f"model_name:sd_queue_wait_seconds:mean5m{{{MODEL}}}", "{{model_name}}")],
        ),
        series_panel(
            "Images per second",
            "Images generated per second.",
            "short",
            [query(f"model_name:sd_images:rate5m{{{MODEL}}}", "{{model_name}}")],
        ),
    ]
    pipeline = [
        series_panel(
            "Batch size",
            "Mean requests admitted together (a TorchServe batch, or the requests joining one "
            "continuous-batching iteration), mean images per denoiser forward (jobs of one latent shape share a "
            "forward whatever their steps and LoRA sets; the step-time profile caps it), of them those that reused "
            "their step cache (DeepCache's deep blocks or the blocks after the first not run), and mean distinct LoRA "
            "adapters per forward (each row gets its "
            "own request's set).",
            "short",
            [
                query(f"model_name:sd_batch_size:mean5m{{{MODEL}}}", "requests per batch {{model_name}}"),
                query(f"model_name:sd_iteration_batch_size:mean5m{{{MODEL}}}", "images per forward {{model_name}}"),
                query(
                    f"model_name:sd_iteration_cached_images:mean5m{{{MODEL}}}",
                    "of them at a cached step {{model_name}}",
                ),
                query(
                    f"model_name:sd_iteration_lora_adapters:mean5m{{{MODEL}}}",
                    "LoRA adapters per forward {{model_name}}",
                ),
            ],
        ),
        series_panel(
            "Denoising step time",
            "Time of one denoising step (one denoiser forward, UNet or transformer, over the jobs stepped together), "
            "and the VAE decode of the jobs that finished together.",
            "s",
            [
                query(f"model_name:sd_denoise_step_seconds:mean5m{{{MODEL}}}", "step mean {{model_name}}"),
                query(f"model_name:sd_denoise_step_seconds:p95_5m{{{MODEL}}}", "step p95 {{model_name}}"),
                query(f"model_name:sd_vae_decode_seconds:mean5m{{{MODEL}}}", "VAE decode mean {{model_name}}"),
            ],
        ),
        series_panel(
            "Queue and in flight per worker",
            "What autoscaling and routing read: images in each worker's denoising loop, requests in a worker "
            "waiting for a step (left out of the last denoiser forward), and requests waiting in TorchServe's queue "
            "for a worker (mean over 5 minutes).",
            "short",
            [
                query(f"sd_in_flight_images{{{MODEL}}}", "images in flight, worker {{worker}} {{Hostname}}"),
                query(f"sd_waiting_requests{{{MODEL}}}", "waiting for a step, worker {{worker}} {{Hostname}}"),
                query(f"model_name:sd_queued_requests:mean5m{{{MODEL}}}", "in TorchServe's queue {{model_name}}"),
            ],
        ),
        series_panel(
            "In flight, deadlines and cancellations",
            "Requests in the denoising loops, requests finished later than the SLA per second, requests "
            "cancelled per second (client gone, or past request_timeout_s), and steps or decodes retried after "
            "running out of memory per second.",
            "short",
            [
                query(f"model_name:sd_in_flight_requests:sum{{{MODEL}}}", "in flight {{model_name}}"),
                query(
                    f"sum by (model_name) (rate(sd_deadline_misses_total{{{MODEL}}}[5m]))",
                    "deadline misses/s {{model_name}}",
                ),
                query(f"model_name_reason:sd_cancelled_requests:rate5m{{{MODEL}}}", "cancelled/s: {{reason}}"),
                query(
                    f"sum by (model_name) (rate(sd_oom_retries_total{{{MODEL}}}[5m]))", "OOM retries/s {{model_name}}"
                ),
            ],
        ),
        series_panel(
            "Errors by status code",
            "4xx and 5xx responses per second (all TorchServe APIs), and rejected "
            "requests by the field that broke a rule.",
            "reqps",
            [
                query('code:ts_requests:rate5m{code=~"4xx|5xx"}', "{{code}}"),
                query(f"model_name_field:sd_invalid_requests:rate5m{{{MODEL}}}", "400 on {{field}}"),
            ],
        ),
        series_panel(
            "Workers",
            "Workers loaded since the server started, worker restarts in 15 minutes, and the "
            "last worker's start time (load, compile, warm-up).",
            "short",
            [
                query("count(WorkerLoadTime)", "workers loaded"),
                query("sum(changes(WorkerLoadTime[15m]))", "restarts (15m)"),
                query(f"sd_worker_warmup_seconds{{{MODEL}}}", "warm-up seconds {{model_name}}"),
            ],
        ),
    ]
    resources = [
        series_panel(
            "CPU and memory",
            "Host CPU and memory utilization (TorchServe system metrics).",
            "percent",
            [query("CPUUtilization", "CPU {{Hostname}}"), query("MemoryUtilization", "memory {{Hostname}}")],
        ),
        series_panel(
            "GPU utilization and memory",
            GPU_ONLY,
            "percent",
            [
                query("GPUUtilization", "GPU {{DeviceId}} {{Hostname}}"),
                query("GPUMemoryUtilization", "GPU memory {{DeviceId}} {{Hostname}}"),
            ],
        ),
    ]
    return [traffic, pipeline, resources]


def build() -> dict:
    board = (
        dashboard.Dashboard("Stable Diffusion on TorchServe")
        .uid(UID)
        .tags(["stable-diffusion", "torchserve"])
        .description("Traffic, latency against the SLA, batching, denoising steps, errors and resources.")
        .refresh("30s")
        .time("now-1h", "now")
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .with_variable(dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(
            dashboard.QueryVariable("model")
            .label("Model")
            .datasource(DATASOURCE)
            .query("label_values(ts_inference_requests_total, model_name)")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .include_all(True)
            .multi(True)
        )
    )
    titles = ["Traffic and latency", "Batching and the step engine", "Resources"]
    for title, row in zip(titles, panels(), strict=True):
        board = board.with_row(dashboard.Row(title))
        for panel in row:
            board = board.with_panel(panel)
    return json.loads(json.dumps(board.build(), cls=JSONEncoder))


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"
