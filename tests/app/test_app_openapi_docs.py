"""The served OpenAPI schema documents everything a client reads or sends: every operation, every parameter and
every property of every schema has a description (what `/docs` and `/redoc` show, and what generated clients carry).
A new field without one fails here."""

FASTAPIS_OWN = {"HTTPValidationError", "ValidationError"}
"""FastAPI's default 422 schemas, added to the spec by the framework (ours is ``ValidationErrorDetail``)."""


def undocumented(spec: dict) -> list[str]:
    missing = []
    for path, operations in spec["paths"].items():
        for method, op in operations.items():
            if not (op.get("description") or op.get("summary")):
                missing.append(f"operation {method.upper()} {path}")
            missing += [f"parameter {p['name']} of {method.upper()} {path}" for p in op.get("parameters", [])
                        if not (p.get("description") or p.get("schema", {}).get("description"))]
    for name, schema in spec["components"]["schemas"].items():
        if name not in FASTAPIS_OWN:
            missing += [f"property {name}.{prop}" for prop, s in schema.get("properties", {}).items()
                        if not s.get("description")]
    return missing


def test_every_operation_parameter_and_property_is_described(client):
    spec = client.get("/openapi.json").json()
    assert not undocumented(spec), undocumented(spec)
    # what the check reads is there: paths, parameters, the multipart forms' fields, the answers' fields
    params = spec["paths"]["/v1/exemplar-sets/{set_id}/checkpoints"]["get"]["parameters"]
    assert {p["name"]: p["description"] for p in params} == {
        "set_id": "The exemplar set's id (its `id`)", "limit": "Items per page (1 to 200)",
        "offset": "Items skipped before the page: a page's `offset` plus its `limit` gives the next one"}
    schemas = spec["components"]["schemas"]
    forms = [n for n in schemas if n.startswith("Body_")]
    assert any("adaptations" in n for n in forms) and any(n.startswith("Body_create_exemplar_set") for n in forms)
    assert "seed" in schemas[next(n for n in forms if "adaptations" in n)]["properties"]
    assert schemas["ExemplarSetPublic"]["properties"]["id"]["description"] == (
        "The set's id: the `{set_id}` of its routes")


def test_the_check_finds_what_is_missing():
    spec = {"paths": {"/x/{id}": {"get": {"parameters": [{"name": "id", "schema": {"type": "string"}},
                                                         {"name": "q", "description": "a query"}]},
                                  "post": {"summary": "makes one"}}},
            "components": {"schemas": {"Thing": {"properties": {"a": {"type": "int"}, "b": {"description": "b"}}},
                                       "ValidationError": {"properties": {"loc": {}}}}}}
    assert undocumented(spec) == ["operation GET /x/{id}", "parameter id of GET /x/{id}", "property Thing.a"]
