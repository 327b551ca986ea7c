"""``--cors-origin`` on every command that serves the gateway: in the help, checked before
anything starts (an error naming the flag), and passed on by ``up`` to its server."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from fleetserve.cli.local import UpOptions
from fleetserve.cli.main import app

COMMANDS = ["server", "gateway", "up"]


@pytest.mark.parametrize("command", COMMANDS)
def test_the_cors_flag_is_in_the_help_of_every_command_serving_the_gateway(command: str) -> None:
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "--cors-origin" in result.output and "scheme://host[:port]" in result.output


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    ("origin", "says"),
    [
        ("https://chat.example.com/app", "no path"),
        ("chat.example.com", "scheme://host"),
        ("https://a:99999", "1-65535"),
    ],
)
def test_a_bad_origin_exits_2_naming_the_flag_before_anything_starts(
    command: str, origin: str, says: str
) -> None:
    result = CliRunner().invoke(
        app, [command, "--cors-origin", "https://ok.example", "--cors-origin", origin], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 2, result.output
    assert "--cors-origin" in result.output and says in result.output


@pytest.mark.parametrize("command", COMMANDS)
def test_a_wildcard_beside_named_origins_exits_2(command: str) -> None:
    result = CliRunner().invoke(app, [command, "--cors-origin", "*", "--cors-origin", "https://ok.example"])
    assert result.exit_code == 2 and "give it alone" in result.output, result.output


def test_up_passes_every_cors_origin_on_to_its_server() -> None:
    args = UpOptions(cors_origins=("https://a.example", "http://localhost:5173")).server_args()
    assert args[4:] == ["--cors-origin", "https://a.example", "--cors-origin", "http://localhost:5173"]
    assert "--cors-origin" not in UpOptions().server_args()
