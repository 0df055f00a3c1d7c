"""The configure transition's steps for ``engine: remote``: connect to ``oxygen-serve``, check the
node's parameters against the model it serves, and build the `RemoteEngine` the tick drives.

No rclpy here: the node passes its logger.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..serving.client import PolicyClient
from ..serving.client_observation import client_robot
from .params import NodeSettings, SettingsError, check_chunk_fits
from .remote_engine import RemoteEngine, ServedModel


def read_api_key(path: str) -> str | None:
    """The key in ``server_api_key_file`` (stripped); None when the parameter is empty.

    Raises:
        SettingsError: the file cannot be read, or is empty.
    """
    if not path:
        return None
    try:
        key = Path(path).expanduser().read_text().strip()
    except OSError as exc:
        raise SettingsError(f"server_api_key_file {path!r} cannot be read: {exc}") from None
    if not key:
        raise SettingsError(f"server_api_key_file {path!r} is empty")
    return key


def check_fits_server(settings: NodeSettings, model: ServedModel) -> None:
    """Raise `SettingsError` when the parameters ask for what the served model cannot give."""
    if settings.robot != client_robot(model.robot):  # a LeRobot folder: robot generic
        raise SettingsError(
            f"the server serves robot {model.robot!r} but robot is {settings.robot!r}: set robot "
            f"{client_robot(model.robot)} (its observation keys and action meaning are the "
            "server's)"
        )
    check_chunk_fits(settings, model.action_horizon, model.action_dim, "the served model")
    if model.state_dim and len(settings.joint_names) != model.state_dim:
        raise SettingsError(
            f"the server reads a {model.state_dim}-value state but joint_names has "
            f"{len(settings.joint_names)} names"
        )


def connect_remote_engine(
    settings: NodeSettings, log: Any, deadline_s: Callable[[], float]
) -> RemoteEngine:
    """Connect to the first reachable of the servers (``server_uri`` or ``server_uris``, waiting
    up to ``server_connect_timeout_s``), check the served model against the parameters and return
    the engine. From here on the client reconnects, or moves on to the next server, by itself,
    using only servers whose model the same check accepts; connections made, lost and switched
    are logged.

    Raises:
        ConnectionError: no connection within the timeout (the message says why).
        SettingsError, ValueError: the key file, an address that is not ws://, or a served model
            the parameters do not fit.
    """
    servers = settings.servers

    def on_change(connected: bool, detail: str) -> None:
        if connected:
            log.info(f"connected to oxygen-serve at {detail}")
        elif len(servers) > 1:
            log.warning(f"no connection to oxygen-serve ({detail}); trying the next server")
        else:
            log.warning(f"no connection to oxygen-serve at {servers[0]}: {detail}; reconnecting")

    client = PolicyClient(
        servers,
        read_api_key(settings.server_api_key_file),
        switch_after_unanswered=settings.server_switch_after_misses,
        failback_probe_s=settings.server_failback_probe_s,
        on_change=on_change,
    )
    client.start()
    try:
        if not client.wait_connected(settings.server_connect_timeout_s):
            raise ConnectionError(
                f"no connection to oxygen-serve at {', '.join(client.uris)} within "
                f"{settings.server_connect_timeout_s:g} s: {client.last_error}"
            )
        model = ServedModel.from_metadata(client.metadata)
        check_fits_server(settings, model)
        client.check_metadata = lambda metadata: check_fits_server(
            settings, ServedModel.from_metadata(metadata)
        )
    except BaseException:
        client.close()
        raise
    others = len(servers) - 1
    log.info(
        f"remote engine: {model.server} at {client.uri} serves robot {model.robot} (horizon "
        f"{model.action_horizon}, {model.action_dim} action dims, session {model.session_id}); "
        f"RTC feedback {'sent' if model.takes_rtc_feedback else 'not taken by this server'}; "
        "narration is the server's (oxygen-serve --narration-every)"
        + (
            f"; {others} other server(s) to move on to after a lost connection or "
            f"{settings.server_switch_after_misses} replies in a row past their deadline or "
            "refused; back to the first once it is ready"
            if others
            else ""
        )
    )
    return RemoteEngine(client, model, deadline_s, len(settings.action_joint_names))
