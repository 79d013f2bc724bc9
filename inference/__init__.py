"""Running compressed models: generation now; the bundled packed-kernel decoder joins later."""
