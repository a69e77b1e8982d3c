"""One lane per worker (its engine loop, client and fault handling); the async engine routes over them."""
