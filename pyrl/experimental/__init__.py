"""pyrl's counterparts of verl's experimental trainers, reached by the same module paths."""
