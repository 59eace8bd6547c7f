/* tf_forked turns 1 in a child forked after the library was loaded. GNU OpenMP's team does not survive a fork
   (a parallel region in such a child waits forever), so the `#ifdef _OPENMP` paths check it and run on threads
   of their own there. Included once, by each library that has OpenMP paths. */
#include <pthread.h>

static int tf_forked = 0;
static void tf_on_fork_child(void) { tf_forked = 1; }
__attribute__((constructor)) static void tf_threads_init(void) { pthread_atfork(NULL, NULL, tf_on_fork_child); }
