"""Controller errors: each carries the HTTP status the REST API answers with, and names what it is about."""

from __future__ import annotations

from kvmesh.shared.errors import KVMeshError


class ControllerError(KVMeshError):
    """An operation the controller could not carry out; `status_code` is its HTTP answer."""

    status_code = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NotFound(ControllerError):
    """An unknown instance, worker or event, or a location the instance does not have (404)."""

    status_code = 404


class CommandTimeout(ControllerError):
    """A worker did not answer within the command timeout, or no worker listens (504)."""

    status_code = 504


class CommandFailed(ControllerError):
    """A worker answered with an error (502)."""

    status_code = 502


class MeshDown(ControllerError):
    """The controller itself is not connected to NATS (503)."""

    status_code = 503


class Refused(ControllerError):
    """A well-formed request the controller will not carry out as asked (409), e.g. a move out of a shared
    store; the message says why."""

    status_code = 409


class TooManyCommands(ControllerError):
    """More pin/unpin/clear requests in flight than `--max-commands`, or /usage requests than
    `--max-usage-requests` (429): retry once some are answered."""

    status_code = 429
