"""The declarative resources an operator writes (YAML or the API), validated with pydantic v2."""
