"""Testing helpers for users of the library and for third-party backends."""
