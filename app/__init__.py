"""qloc's REST service: settings, routes, schemas, tables, blob storage, inference wrapper."""
