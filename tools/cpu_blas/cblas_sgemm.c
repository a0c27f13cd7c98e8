/* MLX's CPU matmuls through the OpenBLAS that numpy ships (tools/cpu_blas/build.py).
 *
 * On Linux the mlx-cpu wheel links the reference BLAS (netlib's, unoptimized: a 256 x 256 by
 * 256 x 1,024 float32 matmul took 22 ms on a 2-core EPYC where OpenBLAS takes 1.3 ms). MLX's CPU
 * backend calls `cblas_sgemm` / `cblas_dgemm` for its float matmuls; preloaded (LD_PRELOAD), this
 * library answers those two symbols with numpy's OpenBLAS (ILP64, its symbols prefixed
 * `scipy_..64_`), same arguments, same results (tests/test_cpu_blas.py). Nothing of MLX is changed;
 * without the preload MLX runs as shipped. */
#include <stdint.h>

extern void scipy_cblas_sgemm64_(int order, int trans_a, int trans_b, int64_t m, int64_t n, int64_t k,
                                 float alpha, const float *a, int64_t lda, const float *b, int64_t ldb,
                                 float beta, float *c, int64_t ldc);
extern void scipy_cblas_dgemm64_(int order, int trans_a, int trans_b, int64_t m, int64_t n, int64_t k,
                                 double alpha, const double *a, int64_t lda, const double *b, int64_t ldb,
                                 double beta, double *c, int64_t ldc);

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc) {
  scipy_cblas_sgemm64_(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_dgemm(int order, int trans_a, int trans_b, int m, int n, int k, double alpha, const double *a, int lda,
                 const double *b, int ldb, double beta, double *c, int ldc) {
  scipy_cblas_dgemm64_(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
