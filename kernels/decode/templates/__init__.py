"""Templates of the decode family (read by ``la_compiler.kernels.common.codegen.template``)."""
