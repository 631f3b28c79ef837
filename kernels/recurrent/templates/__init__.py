"""Templates of the recurrent family (read by ``la_compiler.kernels.common.codegen.template``)."""
