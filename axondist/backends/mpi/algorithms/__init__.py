"""The MPI backend's own algorithms, each kept for a measured win that
:mod:`axondist.backends.mpi.choose` records; every other call runs MPI's collective."""
