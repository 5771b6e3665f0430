"""The HTTP API: routes, request and response models, params, errors, guard, bodies."""
