"""Templates of the chunk family (read by ``la_compiler.kernels.common.codegen.template``)."""
