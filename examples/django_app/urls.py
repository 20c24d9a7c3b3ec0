from django.urls import path

from examples.django_app import views

urlpatterns = [
    path("jobs", views.create_job),
    path("jobs/<str:job_id>", views.job),
]
