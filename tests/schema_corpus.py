"""Fifty JSON schemas of the kinds people send: nested objects, arrays with item bounds, enums, const,
anyOf / oneOf, $ref / $defs, patterns, string lengths, number bounds and nullable fields. Each has a
short task the model is asked to fulfil (the schema itself goes in the prompt too)."""

from __future__ import annotations

from typing import Any


def obj(properties: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
        **extra,
    }


NAME = {"type": "string", "minLength": 1, "maxLength": 24}
SHORT = {"type": "string", "maxLength": 40}
AGE = {"type": "integer", "minimum": 0, "maximum": 120}
EMAIL = {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.(com|org|net)$"}
DATE = {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])$"}
PRICE = {"type": "number", "minimum": 0, "maximum": 10000}
NULLABLE_NAME = {"type": ["string", "null"], "maxLength": 24}
TAGS = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3}
COLOR = {"enum": ["red", "green", "blue"]}
ADDRESS_REF = {"$ref": "#/$defs/address"}
ADDRESS_DEFS = {"address": obj({"street": SHORT, "city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})}

CORPUS: list[tuple[str, dict[str, Any]]] = [
    ("a person", obj({"name": NAME, "age": AGE})),
    ("a user account", obj({"username": {"type": "string", "pattern": "^[a-z]{3,12}$"}, "email": EMAIL})),
    ("a product", obj({"name": NAME, "price": PRICE, "in_stock": {"type": "boolean"}})),
    ("a book", obj({"title": SHORT, "author": NAME, "year": {"type": "integer", "minimum": 1450, "maximum": 2025}})),
    ("a color choice", obj({"color": COLOR})),
    (
        "a yes/no answer",
        obj({"answer": {"enum": ["yes", "no"]}, "confidence": {"type": "number", "minimum": 0, "maximum": 1}}),
    ),
    ("an API version", obj({"version": {"const": "v1"}, "status": {"enum": ["ok", "degraded", "down"]}})),
    ("a list of tags", obj({"tags": TAGS})),
    (
        "a list of scores",
        obj(
            {
                "scores": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 100},
                    "minItems": 2,
                    "maxItems": 4,
                }
            }
        ),
    ),
    (
        "a city with coordinates",
        obj(
            {
                "city": NAME,
                "lat": {"type": "number", "minimum": -90, "maximum": 90},
                "lon": {"type": "number", "minimum": -180, "maximum": 180},
            }
        ),
    ),
    ("an address", {"$defs": ADDRESS_DEFS, **obj({"home": ADDRESS_REF})}),
    (
        "a shipment",
        {
            "$defs": ADDRESS_DEFS,
            **obj(
                {
                    "from": ADDRESS_REF,
                    "to": ADDRESS_REF,
                    "weight_kg": {"type": "number", "exclusiveMinimum": 0, "maximum": 100},
                }
            ),
        },
    ),
    (
        "a company",
        obj(
            {
                "name": NAME,
                "ceo": obj({"name": NAME, "age": AGE}),
                "employees": {"type": "integer", "minimum": 1, "maximum": 100000},
            }
        ),
    ),
    ("an event", obj({"title": SHORT, "date": DATE, "attendees": {"type": "integer", "minimum": 0, "maximum": 500}})),
    (
        "a meeting",
        obj(
            {
                "topic": SHORT,
                "start": {"type": "string", "pattern": "^([01][0-9]|2[0-3]):[0-5][0-9]$"},
                "minutes": {"type": "integer", "minimum": 15, "maximum": 120},
            }
        ),
    ),
    (
        "a pet",
        obj(
            {
                "name": NAME,
                "species": {"enum": ["dog", "cat", "bird", "fish"]},
                "age": {"type": "integer", "minimum": 0, "maximum": 30},
            }
        ),
    ),
    (
        "a recipe",
        obj(
            {
                "dish": NAME,
                "ingredients": {"type": "array", "items": NAME, "minItems": 2, "maxItems": 4},
                "minutes": {"type": "integer", "minimum": 1, "maximum": 240},
            }
        ),
    ),
    ("a movie rating", obj({"movie": SHORT, "stars": {"type": "integer", "minimum": 1, "maximum": 5}})),
    (
        "a contact that may lack a phone",
        obj(
            {"name": NAME, "phone": {"anyOf": [{"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}, {"type": "null"}]}}
        ),
    ),
    ("a nullable nickname", obj({"name": NAME, "nickname": NULLABLE_NAME})),
    (
        "a payment",
        obj(
            {
                "method": {
                    "oneOf": [
                        obj({"card": {"type": "string", "pattern": "^[0-9]{4}$"}}),
                        obj({"iban": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{4}$"}}),
                    ]
                },
                "amount": PRICE,
            }
        ),
    ),
    (
        "a shape",
        obj(
            {
                "shape": {
                    "anyOf": [
                        obj({"kind": {"const": "circle"}, "radius": PRICE}),
                        obj({"kind": {"const": "square"}, "side": PRICE}),
                    ]
                }
            }
        ),
    ),
    (
        "a temperature reading",
        obj({"celsius": {"type": "number", "minimum": -50, "maximum": 60}, "unit": {"const": "C"}}),
    ),
    ("a percentage", obj({"value": {"type": "integer", "minimum": 0, "maximum": 100}})),
    (
        "a student with grades",
        obj(
            {
                "name": NAME,
                "grades": {"type": "array", "items": {"enum": ["A", "B", "C", "D", "F"]}, "minItems": 1, "maxItems": 5},
            }
        ),
    ),
    (
        "a team",
        obj(
            {
                "team": NAME,
                "members": {
                    "type": "array",
                    "items": obj({"name": NAME, "role": {"enum": ["dev", "qa", "pm"]}}),
                    "minItems": 1,
                    "maxItems": 3,
                },
            }
        ),
    ),
    (
        "a key-value setting",
        obj(
            {
                "key": {"type": "string", "pattern": "^[a-z_]{1,16}$"},
                "value": {"type": ["string", "integer", "boolean"], "maxLength": 20},
            }
        ),
    ),
    ("a sentiment label", obj({"text": SHORT, "sentiment": {"enum": ["positive", "negative", "neutral"]}})),
    ("a translation", obj({"source": SHORT, "target": SHORT, "language": {"enum": ["fr", "de", "es"]}})),
    (
        "a search query",
        obj({"query": SHORT, "limit": {"type": "integer", "minimum": 1, "maximum": 50}, "safe": {"type": "boolean"}}),
    ),
    (
        "a car",
        obj(
            {
                "make": NAME,
                "model": NAME,
                "year": {"type": "integer", "minimum": 1990, "maximum": 2025},
                "electric": {"type": "boolean"},
            }
        ),
    ),
    (
        "a flight",
        obj(
            {
                "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "date": DATE,
            }
        ),
    ),
    (
        "an order with items",
        obj(
            {
                "order_id": {"type": "string", "pattern": "^ORD-[0-9]{4}$"},
                "items": {
                    "type": "array",
                    "items": obj(
                        {
                            "sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                            "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                        }
                    ),
                    "minItems": 1,
                    "maxItems": 3,
                },
            }
        ),
    ),
    (
        "a weather report",
        obj(
            {
                "city": NAME,
                "condition": {"enum": ["sunny", "rainy", "cloudy", "snowy"]},
                "high": {"type": "integer", "minimum": -40, "maximum": 50},
            }
        ),
    ),
    (
        "a log entry",
        obj(
            {
                "level": {"enum": ["debug", "info", "warn", "error"]},
                "message": SHORT,
                "code": {"type": ["integer", "null"], "minimum": 100, "maximum": 599},
            }
        ),
    ),
    (
        "an HTTP response",
        obj({"status": {"type": "integer", "minimum": 100, "maximum": 599}, "ok": {"type": "boolean"}}),
    ),
    ("a point in 3D", obj({"x": {"type": "number"}, "y": {"type": "number"}, "z": {"type": "number"}})),
    (
        "a range",
        obj(
            {
                "min": {"type": "integer", "minimum": 0, "maximum": 10},
                "max": {"type": "integer", "minimum": 10, "maximum": 20},
            }
        ),
    ),
    ("a boolean flag set", obj({"dark_mode": {"type": "boolean"}, "beta": {"type": "boolean"}})),
    ("a profile with optional bio", obj({"name": NAME, "bio": SHORT}, required=["name"])),
    (
        "a country",
        obj(
            {
                "name": NAME,
                "code": {"type": "string", "pattern": "^[A-Z]{2}$"},
                "population_millions": {"type": "number", "minimum": 0, "maximum": 2000},
            }
        ),
    ),
    (
        "a tree of categories",
        {
            "$defs": {"leaf": obj({"name": NAME})},
            **obj({"root": NAME, "children": {"type": "array", "items": {"$ref": "#/$defs/leaf"}, "maxItems": 3}}),
        },
    ),
    ("a list of colors", {"type": "array", "items": COLOR, "minItems": 1, "maxItems": 3}),
    ("a single number from 1 to 10", {"type": "integer", "minimum": 1, "maximum": 10}),
    ("a short word", {"type": "string", "pattern": "^[a-z]{2,8}$"}),
    (
        "a status that is either a code or null",
        {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]},
    ),
    ("a task", obj({"title": SHORT, "done": {"type": "boolean"}, "priority": {"enum": [1, 2, 3]}})),
    (
        "an invoice",
        obj(
            {
                "number": {"type": "integer", "minimum": 1, "maximum": 99999},
                "total": PRICE,
                "currency": {"enum": ["EUR", "USD"]},
                "paid": {"type": "boolean"},
            }
        ),
    ),
    ("a song", obj({"title": SHORT, "artist": NAME, "seconds": {"type": "integer", "minimum": 30, "maximum": 600}})),
    (
        "a rectangle",
        obj(
            {
                "width": {"type": "number", "exclusiveMinimum": 0, "maximum": 100},
                "height": {"type": "number", "exclusiveMinimum": 0, "maximum": 100},
            }
        ),
    ),
    (
        "a user with roles",
        obj(
            {
                "user": NAME,
                "roles": {
                    "type": "array",
                    "items": {"enum": ["admin", "editor", "viewer"]},
                    "minItems": 1,
                    "maxItems": 2,
                },
            }
        ),
    ),
]
