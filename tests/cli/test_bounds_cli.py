"""The listener's bounds and the gateway's limits on every command that serves: in the help,
checked before anything starts (an error naming the flag), and passed on by ``up`` to its
server, whose own parser reads them back to the same values."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from fleetserve.cli.main import app
from fleetserve.cli.options import gateway_limits
from fleetserve.gateway.bodylimits import BodyKind
from fleetserve.listener import ListenerLimits

COMMANDS = ["server", "gateway", "up"]
FLAGS = [
    "--max-head-bytes",
    "--max-headers",
    "--head-timeout",
    "--keep-alive-timeout",
    "--max-connections",
    "--body-limit",
    "--max-answer-bytes",
]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_bound_is_in_the_help_of_every_command_that_serves(command: str) -> None:
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for flag in FLAGS:
        assert flag in result.output, flag


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--max-head-bytes", "100"], "--max-head-bytes"),
        (["--max-connections", "0"], "--max-connections"),
        (["--head-timeout", "0"], "--head-timeout"),
        (["--body-limit", "chat.keys=5"], "--body-limit"),
        (["--body-limit", "generation.bytes=1GiB"], "--body-limit"),
        (["--max-answer-bytes", "lots"], "--max-answer-bytes"),
    ],
)
def test_a_bad_bound_exits_2_naming_its_flag_before_anything_starts(
    command: str, args: list[str], flag: str
) -> None:
    result = CliRunner().invoke(app, [command, *args], env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert flag in result.output


def test_up_passes_its_bounds_on_to_its_server_as_flags_its_server_reads_back() -> None:
    limits = ListenerLimits(
        head_bytes=8192, header_count=50, head_timeout=2.5, keep_alive=7, max_connections=300
    )
    flags = dict(flag.split("=", 1) for flag in limits.flags())
    assert (
        ListenerLimits(
            int(flags["--max-head-bytes"]),
            int(flags["--max-headers"]),
            float(flags["--head-timeout"]),
            float(flags["--keep-alive-timeout"]),
            int(flags["--max-connections"]),
        )
        == limits
    )
    parsed = gateway_limits(["generation.keys=4096", "embeddings.bytes=16MiB"], "1MiB")
    assert parsed.bodies[BodyKind.GENERATION].keys == 4096
    assert parsed.bodies[BodyKind.EMBEDDINGS].bytes == 16 << 20
    assert parsed.answer_bytes == 1 << 20 and parsed.read_cap == 16 << 20
    with pytest.raises(typer.BadParameter):
        gateway_limits(None, "100")


def test_up_options_put_the_bounds_on_the_servers_command_line() -> None:
    from fleetserve.cli.local import UpOptions

    bounds = (*ListenerLimits(header_count=50).flags(), "--body-limit=generation.keys=4096")
    args = UpOptions(bounds=bounds).server_args()
    assert "--max-headers=50" in args and "--body-limit=generation.keys=4096" in args
