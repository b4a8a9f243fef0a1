#include <stdint.h>
#include <tgmath.h>
#define BLOCK 512
#define flexgen_sigmoid(z) (1 / (1 + exp(-(z))))
#ifdef FLEXGEN_VECTOR_MATH
#pragma omp declare simd notinbranch
float (expf)(float);
#pragma omp declare simd notinbranch
double (exp)(double);
#pragma omp declare simd notinbranch
float (logf)(float);
#pragma omp declare simd notinbranch
double (log)(double);
#endif
