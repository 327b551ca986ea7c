"""The agent relays a GPU metrics exporter's reading instead of its own (``agent --gpu-exporter``).

The exporters are ``tests/loopback_exporter.py`` serving recorded output of real devices (an NVIDIA
L4's DCGM exporter, an AMD MI300X's device-metrics-exporter) on loopback; the fallback reader is a
stand-in for NVML/sysfs, since this machine has no GPU to read.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from fleetserve.agent.exporter_relay import Candidate, ExporterRelay, candidates
from fleetserve.drivers import Driver
from fleetserve.protocol import GpuSample
from fleetserve.spec.resources import Node
from loopback_exporter import AMD_MI300X, DCGM_L4, FIXTURES, running_exporter

L4_NODE = Node.model_validate(
    {
        "name": "l4-box",
        "cpu": {"cores": 8, "memory": "32GiB"},
        "devices": [{"index": 0, "class": "nvidia-l4"}],
    }
)


DRIVER_OF = {"nvidia-l4": Driver.NVIDIA, "amd-mi300x": Driver.AMD}
OWN_READS: list[Driver] = []  # which of the agent's own readers were asked, in order


def _own(driver: Driver) -> Callable[[Node], list[GpuSample]]:
    def read(node: Node) -> list[GpuSample]:
        OWN_READS.append(driver)
        return [
            GpuSample(
                name="fleetserve_gpu_power_watts",
                labels={
                    "node": node.name,
                    "device": str(d.index),
                    "driver": driver.value,
                    "class": d.device_class,
                },
                value=-1.0,
            )
            for d in node.devices
            if DRIVER_OF[d.device_class] is driver
        ]

    return read


# A stand-in for the agent's own NVML and sysfs reads (no GPU here): one sample per device, -1.
own_reading = {Driver.NVIDIA: _own(Driver.NVIDIA), Driver.AMD: _own(Driver.AMD)}


@pytest.fixture(autouse=True)
def _forget_own_reads() -> None:
    OWN_READS.clear()


MakeRelay = Callable[..., ExporterRelay]


@pytest.fixture
def make_relay() -> Iterator[MakeRelay]:
    """Makes relays; each one's connections are closed at teardown."""
    made: list[ExporterRelay] = []

    def make(*args: Any, **kwargs: Any) -> ExporterRelay:
        made.append(ExporterRelay(*args, **kwargs))
        return made[-1]

    yield make
    for relay in made:
        relay.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_the_relay_reports_the_exporters_reading_for_the_nodes_own_devices(make_relay: MakeRelay) -> None:
    with running_exporter(DCGM_L4) as exporter:
        relay = make_relay(exporter.url, own_reading, interval=60)
        relay.poll()
        samples = {s.name: s for s in relay.read(L4_NODE)}
    labels = {"node": "l4-box", "device": "0", "driver": "gpu.nvidia.com", "class": "nvidia-l4"}
    assert {n: s.labels for n, s in samples.items()} == {n: labels for n in samples}
    assert samples["fleetserve_gpu_power_watts"].value == 16.365, "the exporter's reading, not the agent's"
    assert samples["fleetserve_gpu_temperature_celsius"].value == 31.0
    assert samples["fleetserve_gpu_energy_joules_total"].value == 4742.776
    assert "fleetserve_gpu_tensor_active_ratio" in samples
    assert OWN_READS == [Driver.AMD], "NVML is not read beside the exporter that reads it"


def test_a_device_the_node_does_not_have_is_not_relayed(make_relay: MakeRelay) -> None:
    other = L4_NODE.model_copy(update={"devices": ()})
    with running_exporter(DCGM_L4) as exporter:
        relay = make_relay(exporter.url, own_reading, interval=60)
        relay.poll()
        assert relay.read(other) == []


def test_an_unreachable_exporter_falls_back_to_the_agents_own_reads_said_once(
    make_relay: MakeRelay, caplog: pytest.LogCaptureFixture
) -> None:
    relay = make_relay(f"http://127.0.0.1:{free_port()}/metrics", own_reading, interval=60)
    with caplog.at_level(logging.INFO, logger="fleetserve.agent"):
        relay.poll()
        relay.poll()
        relay.poll()
    assert [s.value for s in relay.read(L4_NODE)] == [-1.0], "NVML's reading where no exporter answers"
    said = [r.getMessage() for r in caplog.records if "GPU metrics" in r.getMessage()]
    assert len(said) == 1, said
    assert "no exporter answers" in said[0] and "reads its GPUs itself" in said[0]


def test_an_exporter_that_stops_answering_goes_stale_then_the_agent_reads_itself(
    make_relay: MakeRelay, caplog: pytest.LogCaptureFixture
) -> None:
    now = [100.0]
    with running_exporter(DCGM_L4) as exporter:
        url = exporter.url
        relay = make_relay(url, own_reading, interval=1, clock=lambda: now[0])
        with caplog.at_level(logging.INFO, logger="fleetserve.agent"):
            relay.poll()
    assert [s.value for s in relay.read(L4_NODE) if s.name == "fleetserve_gpu_power_watts"] == [16.365]
    with caplog.at_level(logging.INFO, logger="fleetserve.agent"):
        now[0] += 2
        relay.poll()  # the exporter is gone; its last reading is still fresh (3 intervals)
        assert [s.value for s in relay.read(L4_NODE) if s.name == "fleetserve_gpu_power_watts"] == [16.365]
        now[0] += 2
        relay.poll()
        relay.poll()
    assert [s.value for s in relay.read(L4_NODE)] == [-1.0]
    said = [r.getMessage() for r in caplog.records if "GPU metrics" in r.getMessage()]
    assert len(said) == 2, said
    assert said[0].startswith(f"GPU metrics: relaying the exporter(s) at {url} (gpu.nvidia.com)")
    assert "no exporter answers" in said[1]


def test_what_is_not_an_exporter_is_not_relayed(make_relay: MakeRelay) -> None:
    with running_exporter(FIXTURES / "llamacpp_b11434_tiny_after_3_requests.prom") as engine:
        relay = make_relay(engine.url, own_reading, interval=60)
        relay.poll()
    assert [s.value for s in relay.read(L4_NODE)] == [-1.0]


def test_each_driver_is_relayed_or_read_on_its_own(make_relay: MakeRelay) -> None:
    mixed = Node.model_validate(
        {
            "name": "mixed",
            "cpu": {"cores": 8, "memory": "32GiB"},
            "devices": [{"index": 0, "class": "amd-mi300x"}, {"index": 1, "class": "nvidia-l4"}],
        }
    )
    with running_exporter(AMD_MI300X) as amd:
        relay = make_relay(amd.url, own_reading, interval=60)
        relay.poll()
        samples = relay.read(mixed)
    amd_samples = [s for s in samples if s.labels["driver"] == "gpu.amd.com"]
    assert [(s.name, s.labels["device"], s.value) for s in amd_samples] == [
        ("fleetserve_gpu_utilization_ratio", "0", 0.0)
    ]
    assert amd_samples[0].labels["class"] == "amd-mi300x"
    nvidia = [(s.labels["device"], s.value) for s in samples if s.labels["driver"] == "gpu.nvidia.com"]
    assert nvidia == [("1", -1.0)], "no NVIDIA exporter answers: the NVIDIA GPU is read by the agent itself"


def test_auto_probes_the_tables_default_ports_on_loopback(make_relay: MakeRelay) -> None:
    assert candidates("auto") == (
        Candidate("http://127.0.0.1:9400/metrics", Driver.NVIDIA),
        Candidate("http://127.0.0.1:5000/metrics", Driver.AMD),
    )
    try:
        exporter_cm = running_exporter(DCGM_L4, port=9400)
        exporter = exporter_cm.__enter__()
    except OSError:
        pytest.skip("127.0.0.1:9400 is taken on this machine")
    try:
        relay = make_relay("auto", own_reading, interval=60)
        relay.poll()
        values = [s.value for s in relay.read(L4_NODE) if s.name == "fleetserve_gpu_power_watts"]
    finally:
        exporter_cm.__exit__(None, None, None)
    assert values == [16.365]
    assert exporter.scrapes == 1


def test_a_gpu_exporter_that_is_no_url_is_refused() -> None:
    with pytest.raises(ValueError, match="give 'auto' or the exporter's metrics URL"):
        candidates("localhost:9400")
    assert candidates("http://a:9400/metrics, http://b:5000/metrics") == (
        Candidate("http://a:9400/metrics"),
        Candidate("http://b:5000/metrics"),
    )


def test_the_relay_polls_on_its_own_thread_until_stopped(make_relay: MakeRelay) -> None:
    with running_exporter(DCGM_L4) as exporter:
        relay = make_relay(exporter.url, own_reading, interval=0.05)
        stop = threading.Event()
        thread = threading.Thread(target=relay.run, args=(stop,))
        thread.start()
        try:
            for _ in range(200):
                if exporter.scrapes >= 3:
                    break
                stop.wait(0.02)
        finally:
            stop.set()
            thread.join(5)
    assert exporter.scrapes >= 3
    assert not thread.is_alive()
