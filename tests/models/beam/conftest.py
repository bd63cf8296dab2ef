from tests.single_thread import one_intra_op_thread  # noqa: F401 - autouse fixture
