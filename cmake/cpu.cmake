# The CPU core: one static library, zk_cpu, from the csrc/ folders' entry points plus one object
# of csrc/simd/path.cpp per ISA ([Note: one instantiation per ISA] there), and (with
# ZKERNELS_BUILD_TESTS) one CTest per kernel family, tests/native/cpp/test_<name>.cpp.
#
# -fno-math-errno: sqrt compiles to the instruction (no errno branch); -ffp-contract=off: no
# silent FMA contraction, so the scalar, AVX2 and AVX-512 paths round identically. The SIMD
# paths carry their own target attributes (csrc/simd/); the objects stay baseline x86-64.
set(ZK_CPU_FLAGS -O3 -fno-math-errno -ffp-contract=off -Wall -Wextra
    -Wno-maybe-uninitialized)  # GCC 12 intrinsic headers: `__m512 __Y = __Y` idiom
set(ZK_CSRC ${CMAKE_CURRENT_SOURCE_DIR}/csrc)

set(ZK_PATH_OBJECTS)
foreach(isa IN ITEMS 0 1 2)  # scalar, avx2, avx512
  add_library(zk_cpu_path${isa} OBJECT ${ZK_CSRC}/simd/path.cpp)
  target_include_directories(zk_cpu_path${isa} PRIVATE ${ZK_CSRC})
  target_compile_definitions(zk_cpu_path${isa} PRIVATE ZK_PATH_ISA=${isa})
  target_compile_options(zk_cpu_path${isa} PRIVATE ${ZK_CPU_FLAGS})
  target_link_libraries(zk_cpu_path${isa} PRIVATE OpenMP::OpenMP_CXX)
  list(APPEND ZK_PATH_OBJECTS $<TARGET_OBJECTS:zk_cpu_path${isa}>)
endforeach()

add_library(zk_cpu STATIC ${ZK_CSRC}/simd/isa.cpp ${ZK_CSRC}/cpu_adam/cpu_adam.cpp
  ${ZK_CSRC}/cpu_ops/cpu_ops.cpp ${ZK_CSRC}/cpu_quant/cpu_quant.cpp
  ${ZK_CSRC}/cpu_adam_lowbit/cpu_adam_lowbit.cpp ${ZK_CSRC}/optim/optimizer.cpp
  ${ZK_PATH_OBJECTS})
target_include_directories(zk_cpu PUBLIC ${ZK_CSRC})
target_compile_options(zk_cpu PRIVATE ${ZK_CPU_FLAGS})
target_link_libraries(zk_cpu PUBLIC OpenMP::OpenMP_CXX)

if(ZKERNELS_BUILD_TESTS)
  foreach(name IN ITEMS cpu_adam cpu_ops cpu_quant optim cpu_adam_lowbit)
    add_executable(test_${name} ${CMAKE_CURRENT_SOURCE_DIR}/tests/native/cpp/test_${name}.cpp)
    target_compile_options(test_${name} PRIVATE -O2 -ffp-contract=off -fno-math-errno -Wall)
    target_link_libraries(test_${name} PRIVATE zk_cpu)
    add_test(NAME ${name} COMMAND test_${name})
  endforeach()
endif()
