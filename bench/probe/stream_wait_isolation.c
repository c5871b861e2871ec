// Probe (H100, driver 580, run R): does a stream blocked on cuStreamWaitValue64 hold up work on
// other streams of the context (Hyper-Q connections shared past CUDA_DEVICE_MAX_CONNECTIONS)?
// Answer there: no. With 40 streams, a memset and a release write queued on any other stream
// ran at once (0.2 ms), with CUDA_DEVICE_MAX_CONNECTIONS unset and 32; a CPU store into
// host-registered memfd memory, and a child process's stream write into its own registration
// of the same memfd, released the waiter too. Build: nvcc -O2 -o /tmp/p stream_wait_isolation.c -lcuda
// usage: exp N K MODE   N streams; stream 0 waits on a word; the release is made
// by MODE: "dev" = cuStreamWriteValue on stream K to a device word,
//          "cpu" = CPU store into host-registered memfd memory,
//          "peer" = a forked child process registers the same memfd and writes it from its stream.
// Also queues a tiny memset on stream K before the release ("probe") and reports whether it ran.
#define _GNU_SOURCE
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char* s; cuGetErrorName(r_, &s); printf("%s failed: %s\n", #x, s); exit(2);} } while (0)
static double now(void){ struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec + t.tv_nsec*1e-9; }
static int poll_stream(CUstream s, double secs){ double t0=now(); for(;;){ CUresult r=cuStreamQuery(s); if(r==CUDA_SUCCESS) return 1; if(r!=CUDA_ERROR_NOT_READY){printf("query err %d\n",r);return -1;} if(now()-t0>secs) return 0; usleep(100);} }
int main(int argc, char** argv){
  int n = atoi(argv[1]), k = atoi(argv[2]); const char* mode = argv[3];
  int fd = memfd_create("exp", 0); if (ftruncate(fd, 4096) != 0) return 3;
  volatile unsigned long long* hw = mmap(0, 4096, PROT_READ|PROT_WRITE, MAP_SHARED, fd, 0);
  hw[0] = 0;
  int pipefd[2]; if (pipe(pipefd) != 0) return 3;
  pid_t child = -1;
  if (!strcmp(mode, "peer")) {
    child = fork();
    if (child == 0) {
      char b; if (read(pipefd[0], &b, 1) != 1) _exit(3);
      CK(cuInit(0)); CUdevice d; CK(cuDeviceGet(&d,0)); CUcontext c; CK(cuDevicePrimaryCtxRetain(&c,d)); CK(cuCtxSetCurrent(c));
      CK(cuMemHostRegister((void*)hw, 4096, CU_MEMHOSTREGISTER_DEVICEMAP|CU_MEMHOSTREGISTER_PORTABLE));
      CUdeviceptr p; CK(cuMemHostGetDevicePointer(&p, (void*)hw, 0));
      CUstream s; CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
      CK(cuStreamWriteValue64(s, p, 1, 0)); CK(cuStreamSynchronize(s));
      _exit(0);
    }
  }
  CK(cuInit(0)); CUdevice d; CK(cuDeviceGet(&d,0)); CUcontext c; CK(cuDevicePrimaryCtxRetain(&c,d)); CK(cuCtxSetCurrent(c));
  CUstream s[128]; for (int i=0;i<n;i++) CK(cuStreamCreate(&s[i], CU_STREAM_NON_BLOCKING));
  CUdeviceptr word, probe; CK(cuMemAlloc(&probe, 4096));
  if (!strcmp(mode,"dev")) { CK(cuMemAlloc(&word, 4096)); CK(cuMemsetD32(word,0,2)); }
  else { CK(cuMemHostRegister((void*)hw, 4096, CU_MEMHOSTREGISTER_DEVICEMAP|CU_MEMHOSTREGISTER_PORTABLE)); CK(cuMemHostGetDevicePointer(&word,(void*)hw,0)); }
  CK(cuStreamWaitValue64(s[0], word, 1, CU_STREAM_WAIT_VALUE_GEQ));
  usleep(20000);
  CK(cuMemsetD32Async(probe, 7, 1, s[k]));
  int probe_ran = poll_stream(s[k], 1.0);
  double t0 = now();
  if (!strcmp(mode,"dev")) CK(cuStreamWriteValue64(s[k], word, 1, 0));
  else if (!strcmp(mode,"cpu")) __atomic_store_n(&hw[0], 1ULL, __ATOMIC_RELEASE);
  else if (write(pipefd[1], "x", 1) != 1) return 3;
  int released = poll_stream(s[0], 3.0);
  printf("n=%d k=%d mode=%s probe_on_k=%s waiter=%s after %.1f ms\n", n, k, mode, probe_ran==1?"ran":"STUCK", released==1?"released":"STUCK", (now()-t0)*1e3);
  fflush(stdout);
  if (child > 0) { int st; waitpid(child,&st,0); }
  _exit(0);
}
