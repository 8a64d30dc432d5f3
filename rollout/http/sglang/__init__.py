"""SGLang's native routes."""
