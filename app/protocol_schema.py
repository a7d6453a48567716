"""Protocol 1 as JSON Schema, generated from the message models in :mod:`arstream.app.protocol`.

One document holds every client->server and server->client message and the model card; the server serves it
at ``GET /v1/protocol.schema.json`` and a copy is committed as ``docs/protocol.schema.json`` (a test fails when
the two drift apart). Regenerate the copy with::

    python -m arstream.app.protocol_schema > docs/protocol.schema.json
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from .protocol import MESSAGE_TYPES, SERVER_MESSAGE_TYPES, ModelCard
from .wire import PROTOCOL_VERSION

SCHEMA_PATH = "/v1/protocol.schema.json"
DRAFT = "https://json-schema.org/draft/2020-12/schema"


def _refs(models: dict[str, type[BaseModel]]) -> dict[str, Any]:
    """A ``oneOf`` of the models, told apart by their ``type`` field."""
    refs = {kind: f"#/$defs/{model.__name__}" for kind, model in models.items()}
    return {
        "oneOf": [{"$ref": ref} for ref in refs.values()],
        "discriminator": {"propertyName": "type", "mapping": refs},
    }


def protocol_schema() -> dict[str, Any]:
    """The whole protocol: ``$defs`` ClientMessage, ServerMessage and ModelCard, and every model they name."""
    models: list[type[BaseModel]] = [*MESSAGE_TYPES.values(), *SERVER_MESSAGE_TYPES.values(), ModelCard]
    _, document = models_json_schema(
        [(model, "validation") for model in models], ref_template="#/$defs/{model}"
    )
    definitions = dict(document["$defs"])
    definitions["ClientMessage"] = _refs(dict(MESSAGE_TYPES))
    definitions["ServerMessage"] = _refs(dict(SERVER_MESSAGE_TYPES))
    return {
        "$schema": DRAFT,
        "$id": SCHEMA_PATH,
        "title": f"ARStream wire protocol {PROTOCOL_VERSION} (docs/PROTOCOL.md): its JSON text messages",
        "description": "A message is a ClientMessage (client to server) or a ServerMessage (server to client). "
        "Fields may be added to either (clients and servers ignore what they do not know); binary frame "
        "messages (the ARF1 header) are described in PROTOCOL.md.",
        "protocol": PROTOCOL_VERSION,
        "oneOf": [{"$ref": "#/$defs/ClientMessage"}, {"$ref": "#/$defs/ServerMessage"}],
        "$defs": dict(sorted(definitions.items())),
    }


def schema_text() -> str:
    """The schema as committed under docs/: sorted keys, two-space indents, a final newline."""
    return json.dumps(protocol_schema(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    print(schema_text(), end="")
